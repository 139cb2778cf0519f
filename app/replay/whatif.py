"""What-if: replay the live session's own arrivals under other settings, beside the live engine.

    job = WhatIfJob.start(log, settings=[{"policy": "chunked"}], since_step=0, engine_config=cfg, ...)
    while job.slice(): ...            # the live engine thread calls this between its own steps
    job.result                        # {"actual": {...}, "whatif": [{...}, ...]}

The arrivals come from app/replay/arrival_log.py: the same prompt token ids, seeds and
sampling parameters, joining at the same step offsets (the first replayed
arrival's step is step 0). Each reply is replayed at the length it had live
(ignore_eos, max_tokens = its live output tokens), so a what-if compares
scheduling, not different reply lengths. Each setting gets a fresh engine (the
live config: same model, device, dtype and KV size, with the setting's policy,
budgets and speculative_config: speculation only where the setting asks for it; prefix caching as the
live engine started unless the setting says `enable_prefix_caching`; the whole KV cache unless it names a
`max_kv_blocks` cap, set after the warm-up), warmed up like demos.compare, then steps through
app.replay.play.play: the same loop demos.compare uses, so a replay and
`python -m demos.compare` give the same steps.

Sharing the CPU: the replay is interleaved with the live engine on its thread,
one replay step after each live step (and back to back while the live engine
is idle), so the two never compete for the cores and a live reply waits at
most one replay step longer per token. The replay engine's clock is a
stopwatch that runs only during its own steps, so its timings are those of an
engine that had the machine to itself. Only loading a replay engine (about a
second) runs on a helper thread, while the live engine keeps stepping.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from app.readers import metrics
from app.replay.arrival_log import Logged
from app.replay.play import engine_meta, longest_prompt, play, warm_up_steps
from app.replay.scenarios import Arrival, Scenario
from engine import EngineConfig, LLMEngine
from engine.scheduling.ngram import SpeculativeConfig

log = logging.getLogger("batchscope.whatif")
SETTING_KEYS = ("policy", "max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk", "speculative_config",
                "enable_prefix_caching", "max_kv_blocks")
BUDGET_KEYS = SETTING_KEYS[1:4]
POLICIES = ("static", "continuous", "chunked")
MAX_SETTINGS = 4


class WhatIfError(ValueError):
    """A replay that cannot run: the message says why (empty log, too long, bad settings)."""


class Stopwatch:
    """An engine clock that runs only while started: replay steps interleaved with live ones
    are timed as if the replay had the machine alone."""

    def __init__(self):
        self.elapsed, self._since = 0.0, None

    def __call__(self) -> float:
        return self.elapsed + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def start(self):
        self._since = time.perf_counter()

    def stop(self):
        self.elapsed, self._since = self(), None


@dataclass
class Replayed:
    """One run for the report (app/readers/report.py): its trace header and records."""
    meta: dict
    stream: list[dict] = field(default_factory=list)


def check_settings(settings) -> list[dict]:
    """The list of settings to try, each checked; a clear error for anything else."""
    if not isinstance(settings, list) or not 1 <= len(settings) <= MAX_SETTINGS:
        raise WhatIfError(f"settings must be a list of 1 to {MAX_SETTINGS} settings, "
                          "e.g. [{\"policy\": \"chunked\"}]")
    out = []
    for i, s in enumerate(settings):
        if not isinstance(s, dict) or not s:
            raise WhatIfError(f"settings[{i}] must be an object with any of {list(SETTING_KEYS)}")
        if unknown := sorted(set(s) - set(SETTING_KEYS)):
            raise WhatIfError(f"settings[{i}]: unknown key(s) {unknown}; use {list(SETTING_KEYS)}")
        if "policy" in s and s["policy"] not in POLICIES:
            raise WhatIfError(f"settings[{i}]: policy must be one of {list(POLICIES)}, got {s['policy']!r}")
        for k in BUDGET_KEYS:
            v = s.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise WhatIfError(f"settings[{i}]: {k} must be a positive integer, got {v!r}")
        if not isinstance(s.get("enable_prefix_caching", True), bool):
            raise WhatIfError(f"settings[{i}]: enable_prefix_caching must be true or false, "
                              f"got {s['enable_prefix_caching']!r}")
        cap = s.get("max_kv_blocks")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise WhatIfError(f"settings[{i}]: max_kv_blocks must be a positive integer or null (every block), "
                              f"got {cap!r}")
        try:
            SpeculativeConfig.of(s.get("speculative_config"))
        except ValueError as e:
            raise WhatIfError(f"settings[{i}]: {e}") from None
        out.append(dict(s))
    return out


def to_scenario(logged: list[tuple[Logged, int]], name: str = "live session") -> Scenario:
    """The logged arrivals as a step-clock scenario: offsets from the first arrival's step, replies as
    long as they were live (at least one token)."""
    if not logged:
        raise WhatIfError("the arrival log has no finished requests to replay; chat first, then try again")
    base = min(a.step for a, _ in logged)
    arrivals = tuple(Arrival(at=a.step - base, label=a.label, max_tokens=max(n, 1),
                             prompt_token_ids=a.prompt_token_ids, temperature=a.params.temperature,
                             seed=a.params.seed, top_k=a.params.top_k, top_p=a.params.top_p)
                     for a, n in sorted(logged, key=lambda x: x[0].step))
    return Scenario(name=name, description=f"{len(arrivals)} requests of the live session, replayed at the steps "
                    "they arrived, each reply as long as it was live.", arrivals=arrivals)


def busy_seconds(records: list[dict]) -> float:
    """Time the live engine spent in steps: about what one replay of them costs."""
    return sum(r["t_end"] - r["t_start"] for r in records if r.get("type") == "step")


def run_summary(stream: list[dict], reqs=None) -> dict:
    return {"metrics": metrics.summarize(stream, reqs), "users": metrics.user_rows(stream, reqs)}


class WhatIfJob:
    """One what-if replay: a list of settings, stepped a slice at a time by the live engine thread."""

    def __init__(self, scenario: Scenario, actual: list[dict], settings: list[dict], engine_config: EngineConfig,
                 live_meta: dict, left_out: int = 0):
        self.scenario, self.actual, self.settings = scenario, actual, settings
        self.engine_config, self.live_meta, self.left_out = engine_config, live_meta, left_out
        self.runs: list[Replayed] = []
        self.result: dict | None = None
        self.error: str | None = None
        self.done = threading.Event()
        total = len(settings) * scenario.total_output_tokens
        self.progress = {"setting": 0, "settings": len(settings), "phase": "queued",
                         "tokens": 0, "tokens_total": total, "fraction": 0.0}
        self.created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._work = self._steps()

    # ---- engine thread ----
    def cancel(self, reason: str):
        """Stop where it is (server shutting down); the caller waiting on it gets `reason`."""
        self.error = reason
        self.progress["phase"] = "failed"
        self.done.set()

    def slice(self) -> bool:
        """Advance the replay by at most one engine step. False once it is over (result or error set)."""
        if self.done.is_set():
            return False
        try:
            try:
                next(self._work)
                return True
            except StopIteration:
                self.result = self._result()
        except Exception as e:              # the replay fails alone; the live engine carries on
            log.exception("the what-if replay failed")
            self.error = f"{type(e).__name__}: {e}"
        self.progress["phase"] = "done" if self.error is None else "failed"
        self.done.set()
        return False

    def _steps(self) -> Iterator[None]:
        for i, setting in enumerate(self.settings):
            self.progress.update(setting=i + 1, phase="loading")
            engine = yield from self._load(setting)
            clock = Stopwatch()
            engine.clock = clock                # replaces the method on this instance only
            self.progress["phase"] = "warm-up"
            yield from self._timed(clock, warm_up_steps(engine, longest_prompt(engine, self.scenario)))
            if setting.get("max_kv_blocks") is not None:     # after the warm-up, whose prompt may not fit under it
                engine.set_policy(max_kv_blocks=setting["max_kv_blocks"])
            run = Replayed(engine_meta(engine, self.scenario))
            engine.subscribe(run.stream.append)
            self.progress["phase"] = "replay"
            yield from self._timed(clock, play(engine, self.scenario), run.stream)
            self.runs.append(run)
            del engine                          # its KV cache goes before the next one is made

    def _load(self, setting: dict):
        """Build the engine on a helper thread; the live engine keeps stepping meanwhile."""
        box: dict = {}
        # speculation only if asked; the KV cap is a live setting of the built engine (_steps), not a config field
        config = replace(self.engine_config, **{"speculative_config": None,
                                                **{k: v for k, v in setting.items() if k != "max_kv_blocks"}})

        def build():
            try:
                box["engine"] = LLMEngine(config)
            except Exception as e:
                box["error"] = e
        t = threading.Thread(target=build, name="batchscope-whatif-load", daemon=True)
        t.start()
        while t.is_alive():
            yield
        if "error" in box:
            raise box["error"]
        return box["engine"]

    def _timed(self, clock: Stopwatch, steps: Iterator, stream: list[dict] | None = None) -> Iterator[None]:
        while True:
            clock.start()
            try:
                next(steps)
            except StopIteration:
                return
            finally:
                clock.stop()
            if stream is not None and stream and stream[-1].get("type") == "step":
                self._count(stream[-1])
            yield

    def _count(self, rec: dict):
        p = self.progress
        p["tokens"] += sum(metrics.tokens_given(i) for i in rec["items"])
        p["fraction"] = round(p["tokens"] / p["tokens_total"], 4) if p["tokens_total"] else 1.0

    @property
    def loading(self) -> bool:
        return self.progress["phase"] in ("queued", "loading")

    # ---- the answer ----
    def _result(self) -> dict:
        reqs = {e["req"] for e in metrics.events(self.actual, "arrived")}
        return {"requests": len(self.scenario.arrivals), "left_out_running": self.left_out,
                "actual": {"settings": self.live_meta.get("settings", {}), **run_summary(self.actual, reqs)},
                "whatif": [{"settings": s, **run_summary(r.stream)} for s, r in zip(self.settings, self.runs)]}

    def report_runs(self) -> dict[str, Replayed]:
        """Name -> run, for app/readers/report.py and the traces: the actual run first."""
        live = self.live_meta.get("settings", {})
        out = {f"actual ({live.get('policy', '?')})": Replayed({**self.live_meta, "created": self.created,
                                                                **_flat(live)}, self.actual)}
        for i, (s, r) in enumerate(zip(self.settings, self.runs)):
            out[f"what-if {i + 1}: {describe(s)}"] = r
        return out


def _flat(settings: dict) -> dict:
    return {k: settings.get(k) for k in SETTING_KEYS}


def describe(setting: dict) -> str:
    """{"policy": "chunked", "max_num_batched_tokens": 128} -> "chunked, budget 128"."""
    parts = [setting.get("policy", "live policy")]
    if "max_num_batched_tokens" in setting:
        parts.append(f"budget {setting['max_num_batched_tokens']}")
    if "max_num_seqs" in setting:
        parts.append(f"{setting['max_num_seqs']} seqs")
    if setting.get("max_prefill_chunk"):
        parts.append(f"chunk cap {setting['max_prefill_chunk']}")
    if setting.get("enable_prefix_caching") is False:
        parts.append("no prefix caching")
    elif setting.get("enable_prefix_caching"):
        parts.append("prefix caching")
    if setting.get("max_kv_blocks"):
        parts.append(f"KV cap {setting['max_kv_blocks']} blocks")
    if spec := setting.get("speculative_config"):
        parts.append(f"speculation k={spec['num_speculative_tokens']}")
    return ", ".join(parts)
