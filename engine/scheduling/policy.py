"""The policy interface: what a scheduling policy sees, what it may do, and the error it gets for a broken rule.

A policy decides each step: which running requests get a token, which prompts get a
chunk and how big, whom to admit, and (when memory runs out) whom to preempt. It sees
the step through a StepView and acts only through it; the scheduler (engine/scheduling/scheduler.py)
checks every action against the rules in its docstring and refuses a broken one with a
PolicyError that names the rule, the step and the request.

    from engine.scheduling.policy import Policy

    class ShortestFirst(Policy):
        name = "shortest-first"

        def schedule(self, step):
            for r in step.decodes:                      # every reply under way gets its token first
                if step.full:
                    break
                if step.is_running(r):
                    step.run(r, 1)
            begun = [r for r in step.running if not r.is_decode and not step.in_step(r)]
            for r in begun + sorted(step.waiting, key=lambda r: r.remaining):   # prompts begun, then the shortest
                if step.full:
                    return
                if step.is_running(r):
                    step.run(r, min(r.remaining, step.budget_left))
                elif step.can_admit and step.blocks_needed(r, r.num_tokens) <= step.free_blocks:
                    step.run(r, min(r.remaining, step.budget_left))

schedule() may instead return a list of (request, tokens) pairs: the scheduler runs them
in order, as if schedule() had called step.run on each. Requests are RequestViews or
their ids. Pure Python: no torch.

The moves the built-in policies share (engine/scheduling/policies/) are at the end, free to any
policy: run_decodes, run_whole_prompts, room_for_whole_prompt, prompts_wait_for_prefill.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduling.sequence import Sequence

# rule -> what it says; a PolicyError names one of these
RULES = {
    "unknown_request": "a step may only name requests that are waiting or running (not finished, aborted or unknown)",
    "duplicate": "a request appears at most once in a step",
    "tokens": "a request runs a whole number of tokens, at least 1 and at most those it has left to compute",
    "decode_one_token": "a request with its prompt done (a decode) runs its one token plus at most its "
                        "drafted tokens (none without speculative decoding: exactly one)",
    "budget": "a step's tokens stay within the token budget (one prompt alone may pass it: it runs on its own)",
    "max_num_seqs": "at most max_num_seqs requests in a step, and none admitted while max_num_seqs are running",
    "kv_capacity": "a request admitted must fit in the free KV blocks (the scheduler preempts only for running ones)",
    "victim": "a preemption victim is a running request",
    "not_in_step": "drop() takes out a request the step holds",
    "stale_view": "a StepView acts only while its step is being built",
    "policy_raised": "the policy's own code raised an exception",
}


class PolicyError(ValueError):
    """A decision the scheduler refused: `rule` (a key of RULES), the step and the request it was about."""

    def __init__(self, rule: str, step: int, req: str | None, detail: str, policy: str = "?"):
        self.rule, self.step, self.req, self.detail, self.policy = rule, step, req, detail, policy
        who = f", request {req}" if req is not None else ""
        super().__init__(f"policy {policy!r} broke rule `{rule}` at step {step}{who}: {detail} "
                         f"(rule: {RULES[rule]})")


class RequestView:
    """One request as a policy sees it: read-only numbers, no token ids, nothing to change."""

    __slots__ = ("_seq", "_step")

    def __init__(self, seq: Sequence, step: StepView):
        self._seq, self._step = seq, step

    def __repr__(self) -> str:
        state = "running" if self._step.is_running(self) else "waiting"
        return (f"<{self.id} {state} prompt={self.prompt_len} computed={self.computed} "
                f"generated={self.generated} remaining={self.remaining}>")

    @property
    def id(self) -> str:
        return self._seq.id

    @property
    def label(self) -> str:
        return self._seq.label

    @property
    def prompt_len(self) -> int:
        return self._seq.prompt_len

    @property
    def num_tokens(self) -> int:
        """Prompt + reply so far: what its KV must cover once it has caught up."""
        return self._seq.num_tokens

    @property
    def computed(self) -> int:
        """Tokens whose KV is in the cache (0 while waiting)."""
        return self._seq.num_computed_tokens

    @property
    def cached(self) -> int:
        """Waiting: tokens the prefix cache would serve if it were admitted now. Running: those it was served."""
        if self._step.is_running(self):
            return self._seq.num_cached_tokens
        return self._step._sched.bm.cached_prefix_tokens(self._seq)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before its next token (waiting: after the prefix cache's share)."""
        s = self._seq
        return s.num_uncomputed_tokens - (0 if self._step.is_running(self) else self.cached)

    @property
    def generated(self) -> int:
        return self._seq.num_output_tokens

    @property
    def drafts(self) -> int:
        """Running decodes under speculative decoding: tokens drafted for it (engine/scheduling/ngram.py),
        of which a step may verify up to all: run(r, 1 + k) with k <= drafts. 0 otherwise."""
        s = self._seq
        return len(s.draft_token_ids) if s.is_prefill_done and self._step.is_running(self) else 0

    @property
    def max_tokens(self) -> int:
        """The most reply tokens its client allowed (the reply may stop earlier)."""
        return self._seq.params.max_tokens

    @property
    def is_decode(self) -> bool:
        """Its next step is one token of a reply under way (a re-admitted request can be one too)."""
        return self.generated > 0 and self.remaining == 1

    @property
    def arrival(self) -> float:
        return self._seq.arrival_time

    @property
    def waited(self) -> float | None:
        """Seconds since it arrived (None without a clock)."""
        now = self._step.now
        return None if now is None else now - self._seq.arrival_time

    @property
    def since_last_token(self) -> float | None:
        """Seconds since its latest token (None before its first token, or without a clock)."""
        now, times = self._step.now, self._seq.token_times
        return None if now is None or not times else now - times[-1]

    @property
    def last_scheduled(self) -> int:
        """The step that last ran it (-1: never); decodes that take turns rotate by it."""
        return self._seq.last_scheduled

    @property
    def preemptions(self) -> int:
        return self._seq.num_preemptions

    @property
    def slo(self) -> str:
        """Its SLO class (e.g. `chat`, `document`): set by whoever added it, `default` otherwise."""
        return self._step._sched.slo_classes.get(self._seq.id, "default")


class StepView:
    """The step being built: the queues, the cache, the budgets, and the two actions (run, drop).

    Everything reads live: after step.run(...) the budget left, the free blocks and the
    queues already show its effect. `sched` is the scheduler building the step
    (engine/scheduling/scheduler.py), read only through its public surface: its queues, budgets,
    `bm`, `find`, `is_running`, `in_step`, `step_tokens`, `run` and `drop`; `batch` is the step so far.
    """

    def __init__(self, sched, batch, index: int, now: float | None = None):
        self._sched, self._batch, self.index = sched, batch, index
        self._views: dict[int, RequestView] = {}
        self.open = True
        self.now = now          # the engine's clock at the step's start (None without one): a value, not a call

    def _view(self, seq: Sequence) -> RequestView:
        v = self._views.get(id(seq))
        if v is None:
            v = self._views[id(seq)] = RequestView(seq, self)
        return v

    # ---- the queues ----
    @property
    def waiting(self) -> list[RequestView]:
        """Requests not yet admitted (or preempted), in queue order: arrival, with preempted ones first."""
        return [self._view(s) for s in self._sched.waiting]

    @property
    def running(self) -> list[RequestView]:
        """Admitted requests (holding KV), in admission order: the newest last."""
        return [self._view(s) for s in self._sched.running]

    @property
    def decodes(self) -> list[RequestView]:
        """Running replies not yet in this step, the one left out longest first (ties: admission order)."""
        sched = self._sched
        ready = [self._view(s) for s in sched.running if s.is_prefill_done and not sched.in_step(s)]
        return sorted(ready, key=lambda r: r.last_scheduled)

    @property
    def items(self) -> list[tuple[RequestView, int]]:
        """(request, tokens) already in this step, in the order they were run."""
        return [(self._view(s), n) for s, n in self._batch.items]

    @property
    def preempted(self) -> list[RequestView]:
        """Requests preempted while building this step (they are waiting again; none can be admitted now)."""
        return [self._view(s) for s in self._batch.preempted]

    def is_running(self, req) -> bool:
        seq = self._sched.find(req)
        return seq is not None and self._sched.is_running(seq)

    def in_step(self, req) -> bool:
        seq = self._sched.find(req)
        return seq is not None and self._sched.in_step(seq)

    # ---- the budgets ----
    @property
    def token_budget(self) -> int:
        return self._sched.token_budget

    @property
    def num_tokens(self) -> int:
        return self._sched.step_tokens

    @property
    def budget_left(self) -> int:
        return self._sched.token_budget - self._sched.step_tokens

    @property
    def max_num_seqs(self) -> int:
        return self._sched.max_num_seqs

    @property
    def max_prefill_chunk(self) -> int | None:
        """The operator's cap on one request's chunk (None: no cap); a policy may honour it."""
        return self._sched.max_prefill_chunk

    @property
    def full(self) -> bool:
        """No token or no sequence slot left in this step."""
        return self.budget_left <= 0 or len(self._batch.items) >= self._sched.max_num_seqs

    @property
    def can_admit(self) -> bool:
        """Someone is waiting and the rules allow an admission now (a slot, no preemption in this step)."""
        s = self._sched
        return (bool(s.waiting) and not self._batch.preempted and len(s.running) < s.max_num_seqs
                and len(self._batch.items) < s.max_num_seqs)

    # ---- the cache ----
    @property
    def free_blocks(self) -> int:
        """Blocks that may still be taken (under the `max_kv_blocks` cap when one is set)."""
        return self._sched.bm.num_free

    @property
    def total_blocks(self) -> int:
        """Blocks that may be in use at once: the cache, or its `max_kv_blocks` cap."""
        return self._sched.bm.capacity

    @property
    def block_size(self) -> int:
        return self._sched.bm.block_size

    def blocks_needed(self, req, num_tokens: int) -> int:
        """New blocks `req` needs so its KV covers num_tokens tokens (a waiting request holds none yet)."""
        return self._sched.bm.blocks_needed(self._sched.find(req, must=True), num_tokens)

    # ---- the step cost ----
    @property
    def cost(self):
        """The measured step-cost fit (app/readers/analysis.py CostFit: seconds ~ a + b*tokens + c*context), or None."""
        return self._sched.cost_fit

    def predict(self, tokens: int, context: int = 0) -> float | None:
        """Predicted seconds of a step of `tokens` tokens reading `context` keys (None without a fit)."""
        f = self._sched.cost_fit
        return None if f is None else f.a + f.b * tokens + f.c * context

    # ---- the actions ----
    def run(self, req, num_tokens: int) -> bool:
        """Put `num_tokens` of `req` in this step (admitting it if it waits). False when it did not run:
        it was preempted to make room (its own victim hook chose it), or this step already preempted
        and it waits. A broken rule raises PolicyError."""
        return self._sched.run(self, req, num_tokens)

    def drop(self, req):
        """Take `req` back out of this step; it keeps its place and the KV of what it computed (continuous:
        decodes wait); a block taken for this step's tokens goes back once the step is built."""
        self._sched.drop(self, req)


class Policy:
    """A scheduling policy. Subclass it, give it a `name`, write schedule(); the rest has defaults.

    prefill_cause: what a reply left out of a step that carries prompt tokens is told
    (`prefill`; static batching says `static_batch`).
    """

    name = "policy"
    prefill_cause = "prefill"

    def schedule(self, step: StepView) -> Iterable | None:
        raise NotImplementedError("a policy must define schedule(step)")

    def victim(self, step: StepView, needy: RequestView) -> RequestView | str:
        """Memory ran out while `needy` (a running request) asked for blocks: whom to preempt.
        Default (vLLM's rule): the newest admitted request, even one already in this step."""
        return step.running[-1]

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


def req_id(req) -> str:
    """A RequestView or a request id -> the id."""
    return req.id if isinstance(req, RequestView) else req


# ---- moves the built-in policies share (engine/scheduling/policies/), free to any policy ----
def run_decodes(step: StepView):
    """Every running reply its token while the step has room; the one left out longest goes first,
    so with fewer slots than replies they take turns. Under speculative decoding a reply also runs
    its drafted tokens, on budget no later reply's own token needs."""
    decodes = step.decodes
    for i, r in enumerate(decodes):
        if step.full:
            return
        if step.is_running(r):          # an earlier decode's blocks may have preempted it
            later = min(len(decodes) - i - 1, step.max_num_seqs - len(step.items) - 1)
            step.run(r, 1 + max(0, min(r.drafts, step.budget_left - 1 - later)))


def run_whole_prompts(step: StepView):
    """Running prompts not yet prefilled, each whole, packed under the budget (the first always goes)."""
    for r in step.running:
        if r.is_decode or not step.is_running(r) or step.in_step(r) or len(step.items) >= step.max_num_seqs:
            continue
        if step.items and r.remaining > step.budget_left:
            return
        step.run(r, r.remaining)


def room_for_whole_prompt(step: StepView, r: RequestView) -> bool:
    """Admit only what fits whole in the free blocks, so admitted prompts are not preempted again and again."""
    return step.blocks_needed(r, r.num_tokens) <= step.free_blocks


def prompts_wait_for_prefill(step: StepView):
    """A step that carries whole prompts carries no decode: a re-admitted request that is really a
    decode waits with the others (the second generation's stall)."""
    if any(not r.is_decode for r, _ in step.items):
        for r, _ in step.items:
            if r.is_decode:
                step.drop(r)
        return True
    return False
