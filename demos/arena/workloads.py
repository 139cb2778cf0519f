"""The arena's seeded workloads and SLOs, on a clock that scales to the machine.

Times are in τ ("tau"): the predicted seconds of one full step on this machine, a step of
`token_budget` fresh prompt tokens, from the measured step-cost fit (app/readers/analysis.py):
τ = a + b·budget + c·budget. An arrival `at` 12 τ and a TBT limit of 2 τ mean the same on
a laptop and on a GPU, so a score means the same too.

    chat-burst            24 chats arrive within a few steps: who is admitted first decides TTFT
    long-documents        chats keep arriving while four ~1,500-token documents come in
    shared-system-prompt  every request starts with the same 400-token system prompt (prefix cache)
    class-log             the class's own arrival log, saved from the server (GET /api/whatif/log)

Prompts are token ids drawn from a seeded generator (the model-free simulator and the real
engine see the same ids); replies have exactly max_tokens tokens (ignore_eos).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

FIRST_ID, LAST_ID = 1000, 40000          # plain vocabulary ids every default-sized tokenizer has


@dataclass(frozen=True)
class Slo:
    """A class of requests and what its users tolerate, in τ."""
    ttft: float                          # TTFT limit: this many full steps ...
    ttft_per_prompt: float               # ... plus this many times the full steps its own prompt needs
    tbt: float                           # the longest gap between two of its tokens

    def limits(self, tau: float, prompt_len: int, budget: int) -> tuple[float, float]:
        """(TTFT limit, TBT limit) in seconds."""
        return tau * (self.ttft + self.ttft_per_prompt * prompt_len / budget), tau * self.tbt


SLOS = {"chat": Slo(ttft=8.0, ttft_per_prompt=1.0, tbt=2.0),
        "document": Slo(ttft=8.0, ttft_per_prompt=1.5, tbt=3.0)}


@dataclass(frozen=True)
class Job:
    at: float                            # arrival, τ from the start
    label: str
    prompt: tuple[int, ...]              # token ids
    max_tokens: int                      # reply tokens (exactly)
    slo: str = "chat"                    # a key of SLOS


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    jobs: tuple[Job, ...]
    token_budget: int = 128
    max_num_seqs: int = 16
    num_kv_blocks: int = 512             # KV blocks of block_size tokens: the same cache in both modes
    block_size: int = 16
    slos: dict = field(default_factory=lambda: dict(SLOS))
    enable_prefix_caching: bool = True   # both modes; lesson 6's switch
    max_kv_blocks: int | None = None     # a cap on the blocks in use (lesson 7's); None: every block

    def __post_init__(self):
        if not self.jobs:
            raise ValueError(f"workload {self.name!r} has no requests")
        if list(self.jobs) != sorted(self.jobs, key=lambda j: j.at):
            raise ValueError(f"workload {self.name!r}: jobs must be sorted by arrival")
        need = max(-(-(len(j.prompt) + j.max_tokens) // self.block_size) for j in self.jobs)
        room = self.num_kv_blocks if self.max_kv_blocks is None else min(self.max_kv_blocks, self.num_kv_blocks)
        if need > room:
            raise ValueError(f"workload {self.name!r}: a request needs {need} KV blocks, the cache has "
                             f"{room}{' under its cap' if room < self.num_kv_blocks else ''}")

    @property
    def output_tokens(self) -> int:
        return sum(j.max_tokens for j in self.jobs)


def ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, LAST_ID) for _ in range(n))


def chat_burst(seed: int = 1, n: int = 24, scale: float = 1.0) -> Workload:
    rng = random.Random(seed)
    jobs = [Job(at=round(rng.uniform(0, 4), 3), label=f"chat{i + 1}", prompt=ids(rng, int(rng.choice(
        [24, 40, 64, 96, 160, 320]) * scale) or 1), max_tokens=max(2, int(rng.randint(12, 40) * scale)))
            for i in range(n)]
    return Workload("chat-burst", f"{n} chats arrive within 4 τ (prompts 24-320 tokens, replies 12-40): "
                    "the queue is long, and who is admitted first decides how many first tokens come in time.",
                    tuple(sorted(jobs, key=lambda j: j.at)))


def long_documents(seed: int = 2, chats: int = 20, docs: int = 4, scale: float = 1.0) -> Workload:
    rng = random.Random(seed)
    jobs = [Job(at=round(i * 3.0 + rng.uniform(0, 1), 3), label=f"chat{i + 1}",
                prompt=ids(rng, int(rng.choice([32, 48, 80]) * scale) or 1),
                max_tokens=max(2, int(rng.randint(24, 48) * scale))) for i in range(chats)]
    jobs += [Job(at=round(6.0 + k * 14.0, 3), label=f"doc{k + 1}", prompt=ids(rng, int(1500 * scale) or 1),
                 max_tokens=max(2, int(24 * scale)), slo="document") for k in range(docs)]
    return Workload("long-documents", f"{chats} chats, one every 3 τ, while {docs} documents of ~1,500 tokens "
                    "arrive: a whole-prompt prefill freezes every reply; chunks keep them going.",
                    tuple(sorted(jobs, key=lambda j: j.at)))


def shared_system_prompt(seed: int = 3, n: int = 24, scale: float = 1.0) -> Workload:
    rng = random.Random(seed)
    system = ids(rng, int(400 * scale) or 1)
    jobs = [Job(at=round(i * 0.75, 3), label=f"user{i + 1}", prompt=system + ids(rng, rng.randint(8, 40)),
                max_tokens=max(2, int(rng.randint(16, 32) * scale))) for i in range(n)]
    return Workload("shared-system-prompt", f"{n} requests, one every 0.75 τ, all starting with the same "
                    f"{len(system)}-token system prompt: after the first, the prefix cache serves it.",
                    tuple(jobs), num_kv_blocks=256)


def class_log(path: str, fit_here=None) -> Workload:
    """A saved arrival log: the class's requests at their arrival times, in τ of the machine that served
    them (fitted on the log's own records; without any, `fit_here`'s: the log is taken to come from this
    machine), prompts over 512 tokens in the `document` class. The log's prefix caching and KV cap (the
    settings when it was saved) are the workload's; its speculative decoding is not: the simulator never
    drafts, and the arena's real engine runs without speculation (docs/arena.md)."""
    from app.replay.arrival_log import from_saved
    doc = json.loads(Path(path).read_text())
    logged = from_saved(doc)
    if not logged:
        raise ValueError(f"{path}: the arrival log has no finished requests")
    settings = doc.get("settings", {})
    budget = settings.get("max_num_batched_tokens") or 128
    tau = live_tau(doc.get("records", []), budget) or (tau_of(fit_here, budget) if fit_here else None)
    if not tau or tau <= 0:
        raise ValueError(f"{path}: the log's records give no step cost to scale its times by; pass --cost a,b,c")
    t0 = min(a.t for a, _ in logged)
    jobs = tuple(sorted((Job(at=round((a.t - t0) / tau, 3), label=a.label, prompt=a.prompt_token_ids,
                             max_tokens=max(n, 1), slo="document" if len(a.prompt_token_ids) > 512 else "chat")
                         for a, n in logged), key=lambda j: j.at))
    spec = " Served live with speculative decoding, replayed without it." if settings.get("speculative_config") else ""
    return Workload("class-log", f"{len(jobs)} requests of the class's own session ({Path(path).name}), at the "
                    f"times they arrived, each reply as long as it was live.{spec}", jobs, token_budget=budget,
                    max_num_seqs=settings.get("max_num_seqs") or 16,
                    num_kv_blocks=max(512, max(-(-(len(j.prompt) + j.max_tokens) // 16) for j in jobs)),
                    enable_prefix_caching=settings.get("enable_prefix_caching", True) is not False,
                    max_kv_blocks=settings.get("max_kv_blocks"))


def live_tau(records: list[dict], budget: int) -> float | None:
    """τ of the machine that recorded these step records (None when they cannot be fitted)."""
    from app.readers.analysis import fit_stream
    fits = fit_stream(records)
    return tau_of(fits[0], budget) if fits else None


def tau_of(fit, budget: int) -> float:
    return fit.a + fit.b * budget + fit.c * budget


WORKLOADS = {"chat-burst": chat_burst, "long-documents": long_documents, "shared-system-prompt": shared_system_prompt}


def get_workload(name: str, scale: float = 1.0) -> Workload:
    """A seeded workload; `scale` shrinks prompts and replies (tests run them small)."""
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)} or give --log FILE")
    return WORKLOADS[name](scale=scale)
