"""The scheduler: which sequences run in the next forward pass, and how many tokens each.

Pure Python, no tensors. schedule() asks the policy in force (engine/scheduling/policy.py) to build
the step through a StepView, checks every action against the rules below, and returns a
Batch: a list of (sequence, num_tokens), where num_tokens is 1 for a decode (1 + k when it
verifies k drafted tokens, engine/scheduling/ngram.py) and a chunk length for a prefill.
The three generations of LLM serving are built-in policies
(engine/scheduling/policies/), written on the same interface as any other:

  static      a batch is formed (the whole prompts the budget holds), prefilled in
              one step, and decoded until every member has finished; nothing
              joins mid-batch (request-level batching).
  continuous  iteration-level, prefill-first: whenever waiting prompts fit, the
              step prefills them whole and running decodes wait (Orca / vLLM v0
              without chunking): replies stall while a long prompt is prefilled.
  chunked     decode-first under a token budget: every running sequence gets its
              token, the leftover budget goes to prefill chunks (Sarathi-Serve
              stall-free batching).

Under static and continuous a prompt is always prefilled whole, so a prompt
longer than the token budget runs alone in a step of its own length.

Rules the scheduler checks, for every policy (a broken one raises PolicyError naming
the rule, the step and the request; the step is undone: admissions go back to the
queue, so no block is held by a request that is not running):
  - unknown_request, duplicate: a step names waiting or running requests, each once;
  - tokens, decode_one_token: a request runs 1 to its remaining tokens (after the prefix
    cache's share); a decode runs its one token plus at most its drafted ones: 1 + k tokens,
    k <= len(draft_token_ids) (speculative decoding, engine/scheduling/ngram.py; without
    speculation a decode has no drafts and runs exactly one);
  - budget: the step's tokens stay within max_num_batched_tokens, except one prompt
    alone, which may pass it;
  - max_num_seqs: at most max_num_seqs items, and no admission while that many run;
  - kv_capacity: an admitted request's tokens fit in the free blocks;
  - victim: when a running request's tokens do not fit, the policy's victim() names a
    running request to preempt (default, vLLM's rule: the newest admitted, even one
    already placed in this step), until they fit or the request itself is chosen.
Rules the scheduler keeps itself:
  - a batch is laid out decodes first (those of one token, then those verifying drafts),
    then prefill chunks, whatever order the policy ran them in (a request re-admitted after
    preemption whose prefix cache covers all but its newest token is a decode);
  - a decode that verified k drafts keeps the a <= k its sampler accepted: its KV covers
    its last token and those a, and the blocks taken for the rejected k - a alone go back
    (update(); BlockManager.trim), so a rejected guess leaks no block;
  - a step that preempted admits nobody new (run() on a waiting request returns False):
    the memory freed belongs to those already running;
  - every running reply left out of the step gets a cause: `prefill` (the policy's
    prefill_cause, `static_batch` for static) when the step carries prompt tokens, else
    `no_slot` (max_num_seqs reached), `budget` (no token left) or `policy` (the policy
    left it out with room to spare).
What the built-in policies add (tests/test_scheduler_properties.py checks them):
  - fairness: when fewer slots (budget, max_num_seqs) than ready decodes, the
    request left out longest goes first, so each gets a token at least every
    ceil(decodes / slots) steps;
  - admission needs room for the whole remaining prompt, so admitted prompts are
    not preempted again and again.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import check_budgets
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policy import Policy, PolicyError, RequestView, StepView, req_id
from engine.scheduling.sequence import Sequence, Status


@dataclass
class Batch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # speculative decoding, filled by update(): seq id -> drafted tokens it kept (of items[].tokens - 1)
    accepted: dict[str, int] = field(default_factory=dict)
    # why each running decode was left out: seq id -> (cause, by, by_tokens)
    left_out: dict[str, tuple[str, str | None, int | None]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __contains__(self, seq: Sequence) -> bool:
        return any(s is seq for s, _ in self.items)

    def remove(self, seq: Sequence):
        self.items = [(s, n) for s, n in self.items if s is not seq]


class Scheduler:
    def __init__(self, block_manager: BlockManager, policy: Policy, max_num_batched_tokens: int,
                 max_num_seqs: int, max_prefill_chunk: int | None = None):
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # admission order: the newest is preempted first
        self.num_steps = 0
        self.cost_fit = None                   # a measured step-cost fit a policy may read (app/readers/analysis.py)
        self.slo_classes: dict[str, str] = {}  # request id -> SLO class, for policies that read it
        # while a step is built: who is where, by id(seq), so each check is O(1) (the lists stay the truth)
        self._admitted: list[Sequence] = []    # admitted in this step: undone if it is refused
        self._running_ids: set[int] = set()
        self._waiting_ids: set[int] = set()
        self._by_id: dict[str, Sequence] = {}
        self._in_batch: set[int] = set()
        self._batch_tokens = 0
        self.max_model_len: int | None = None  # the engine's limit on a sequence's length, when it has one
        self.set_policy(policy, max_num_batched_tokens, max_num_seqs, max_prefill_chunk)

    def set_policy(self, policy: Policy, max_num_batched_tokens: int, max_num_seqs: int,
                   max_prefill_chunk: int | None):
        """Any Policy object (engine/scheduling/policy.py); policies.resolve("chunked") gives a built-in one."""
        if not isinstance(policy, Policy):
            raise TypeError(f"the scheduler takes a Policy object, not {policy!r}: "
                            "engine.scheduling.policies.resolve(name) gives a built-in one")
        check_budgets(max_num_batched_tokens, max_num_seqs, max_prefill_chunk)
        self.policy_object = policy
        self.policy = policy.name
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_chunk = max_prefill_chunk

    def set_cache(self, enable_prefix_caching: bool | None = None, max_kv_blocks: int | None | str = "keep"):
        """The cache's live settings, from the next step; None (or "keep" for the cap) keeps a value.

        max_kv_blocks caps the blocks in use (None: every block allocated). Lowered below the blocks in
        use, it takes nothing away: admissions wait and a running request that needs a block preempts the
        policy's victim (recompute), until the rest fit. It may not go below what one live request needs
        on its own (its prompt and full reply), or that request could never finish.
        """
        bm = self.bm
        if max_kv_blocks != "keep":
            cap = bm.check_capacity(max_kv_blocks)  # a ValueError naming a bad value
            need = max(((self.blocks_for_whole(s), s.id) for s in (*self.running, *self.waiting)), default=None)
            if need is not None and need[0] > cap:
                raise ValueError(f"max_kv_blocks={max_kv_blocks} is below the {need[0]} blocks request "
                                 f"{need[1]!r} needs on its own (prompt and full reply); it could never finish")
        if enable_prefix_caching is not None:
            bm.set_prefix_caching(enable_prefix_caching)
        if max_kv_blocks != "keep":
            bm.set_capacity(max_kv_blocks)

    def blocks_for_whole(self, seq: Sequence) -> int:
        """Blocks seq holds at its longest (prompt and full reply)."""
        return self._blocks_for_length(seq.max_num_tokens)

    def _blocks_for_length(self, num_tokens: int) -> int:
        limit = self.max_model_len
        return self.bm.blocks_for(num_tokens if limit is None else min(num_tokens, limit))

    def check_fits(self, prompt_len: int, max_tokens: int):
        """A new request must fit in the cache on its own (the live cap included), or it could never run."""
        need = self._blocks_for_length(prompt_len + max_tokens)
        if need > self.bm.capacity:
            raise ValueError(f"the request needs {need} KV blocks for its prompt ({prompt_len} tokens) and reply "
                             f"(max_tokens {max_tokens}); the cache is capped at {self.bm.capacity} blocks "
                             "(max_kv_blocks)")

    def settings(self) -> dict:
        return {"policy": self.policy, "max_num_batched_tokens": self.token_budget,
                "max_num_seqs": self.max_num_seqs, "max_prefill_chunk": self.max_prefill_chunk,
                "enable_prefix_caching": self.bm.enable_prefix_caching, "max_kv_blocks": self.bm.max_kv_blocks}

    # ---- queue changes ----
    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def remove(self, seq: Sequence):
        """Take a finished or aborted sequence out of the queues and give back its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ----
    def schedule(self, now: float | None = None) -> Batch:
        """The policy builds the step; a broken rule undoes it and raises PolicyError (nothing leaks).
        now: the engine's clock at the step's start (StepView.now: a policy waits by it); None without one."""
        batch = Batch()
        self._admitted, self._dropped, self._in_batch, self._batch_tokens = [], [], set(), 0
        self._running_ids, self._waiting_ids = {id(s) for s in self.running}, {id(s) for s in self.waiting}
        self._by_id = {s.id: s for s in (*self.running, *self.waiting)}
        step = StepView(self, batch, self.num_steps, now)
        waiting_before = list(self.waiting)
        try:
            self._build(step)
        except PolicyError:
            self._undo(batch, waiting_before)
            raise
        finally:
            step.open = False
        for seq in self._dropped:               # one the step took back out holds what it computed
            if id(seq) in self._running_ids and id(seq) not in self._in_batch:
                self.bm.trim(seq, seq.num_computed_tokens)
        self._left_out(batch)
        # decodes first: the runner lays out one token per decode, then decodes verifying drafts, then
        # the chunks (stable: order kept)
        batch.items.sort(key=lambda item: 2 if not item[0].is_prefill_done else 0 if item[1] == 1 else 1)
        for seq, _ in batch.items:
            seq.last_scheduled = self.num_steps
        self.num_steps += 1
        return batch

    def update(self, batch: Batch, tokens: list[int | list[int] | None], now: float,
               ended: Callable[[Sequence], bool] | None = None) -> list[tuple[Sequence, int | None]]:
        """After the forward pass: count the computed tokens, publish full blocks, append the sampled tokens.

        tokens: one entry per sequence whose step completed its known tokens, in batch order: its next
        token; for a decode that verified drafts, the list of drafts it accepted followed by the token
        sampled after them; None where the logits were non-finite (that sequence publishes nothing to
        the prefix cache: its KV is suspect). ended(seq), called after each token appended (the engine's
        StopCheck, engine/outputs/requests.py), says the reply is over: the rest of a verified run is dropped.
        Returns (sequence, token) for each token appended (and each None); ending a request is the engine's call.
        """
        sampled, out = iter(tokens), []
        for seq, n in batch.items:
            drafted = n - 1 if seq.is_prefill_done else 0   # read before the step moves it on
            seq.draft_token_ids = []
            if seq.num_computed_tokens + n - drafted < seq.num_tokens:   # a chunk that did not finish the prompt
                seq.num_computed_tokens += n
                self.bm.commit_full_blocks(seq)
                continue
            token = next(sampled)
            if token is None:
                seq.num_computed_tokens += n - drafted
                out.append((seq, None))
                continue
            run = token if isinstance(token, list) else [token]
            accepted = len(run) - 1
            # the KV of the last token and of the accepted drafts stays; the rejected drafts' is rolled back
            seq.num_computed_tokens += n - (drafted - accepted)
            if drafted:
                self.bm.trim(seq, seq.num_computed_tokens)
            self.bm.commit_full_blocks(seq, run[:accepted])
            for kept, t in enumerate(run, 1):
                seq.append_token(t, now)
                out.append((seq, t))
                if ended is not None and ended(seq):
                    del seq.logprobs[seq.num_output_tokens:]     # those of the tokens dropped after the end
                    break
            if drafted:                 # what the reply kept: a stop among the accepted drafts drops the rest
                batch.accepted[seq.id] = kept - 1
        return out

    def _build(self, step: StepView):
        """The policy's schedule(): its step.run calls, then the (request, tokens) pairs it returns."""
        try:
            for req, n in self.policy_object.schedule(step) or ():
                step.run(req, n)
        except PolicyError:
            raise
        except Exception as e:                  # a bug in the policy's own code
            raise self._error("policy_raised", step, None, f"{type(e).__name__}: {e}") from e

    # ---- the policy's actions, checked ----
    def run(self, step: StepView, req, n) -> bool:
        """StepView.run, checked against the rules."""
        seq = self._check_open(step, req)
        batch = step._batch
        if seq is None:
            raise self._error("unknown_request", step, req_id(req), "it is not waiting or running "
                              "(finished, aborted, or never added)")
        if id(seq) in self._in_batch:
            raise self._error("duplicate", step, seq.id, "it is already in this step")
        waiting = id(seq) not in self._running_ids
        if waiting and batch.preempted:
            return False                        # a step that preempted admits nobody new
        hit = self.bm.cached_prefix_tokens(seq) if waiting else 0
        left = seq.num_uncomputed_tokens - hit
        drafts = len(seq.draft_token_ids) if not waiting and seq.is_prefill_done else 0
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= left + drafts:
            if seq.num_output_tokens and left == 1:
                raise self._error("decode_one_token", step, seq.id, f"it is decoding with {drafts} drafted "
                                  f"tokens (1 to {1 + drafts} tokens), asked for {n!r}")
            raise self._error("tokens", step, seq.id, f"asked for {n!r} tokens; it has {left} left to compute")
        if batch.items and self._batch_tokens + n > self.token_budget:
            raise self._error("budget", step, seq.id, f"{n} more tokens would make {self._batch_tokens + n}, "
                              f"over the budget of {self.token_budget}")
        if len(batch.items) >= self.max_num_seqs:
            raise self._error("max_num_seqs", step, seq.id, f"the step already holds {len(batch.items)} "
                              f"requests (max_num_seqs {self.max_num_seqs})")
        if waiting:
            return self._admit(step, seq, n)
        if not self._reserve(step, seq, n):
            return False
        self._place(batch, seq, n)
        return True

    def _place(self, batch: Batch, seq: Sequence, n: int):
        batch.items.append((seq, n))
        self._in_batch.add(id(seq))
        self._batch_tokens += n

    def _unplace(self, batch: Batch, seq: Sequence):
        if id(seq) in self._in_batch:
            self._batch_tokens -= next(n for s, n in batch.items if s is seq)
            self._in_batch.discard(id(seq))
            batch.remove(seq)

    def _admit(self, step: StepView, seq: Sequence, n: int) -> bool:
        if len(self.running) >= self.max_num_seqs:
            raise self._error("max_num_seqs", step, seq.id, f"{len(self.running)} requests are running "
                              f"(max_num_seqs {self.max_num_seqs}): no admission")
        self.bm.match_prefix(seq)
        if not self.bm.allocate(seq, seq.num_computed_tokens + n):
            need = self.bm.blocks_needed(seq, seq.num_computed_tokens + n)
            self.bm.undo_match(seq)             # waiting sequences hold no blocks
            raise self._error("kv_capacity", step, seq.id, f"admitting it with {n} tokens needs {need} "
                              f"more blocks, {self.bm.num_free} are free")
        self.waiting.remove(seq)
        self._waiting_ids.discard(id(seq))
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._running_ids.add(id(seq))
        self._admitted.append(seq)
        self._place(step._batch, seq, n)
        return True

    def drop(self, step: StepView, req):
        """StepView.drop, checked."""
        seq = self._check_open(step, req)
        if seq is None or id(seq) not in self._in_batch:
            raise self._error("not_in_step", step, req_id(req), "drop() of a request this step does not hold")
        self._unplace(step._batch, seq)
        self._dropped.append(seq)

    def _reserve(self, step: StepView, seq: Sequence, n: int) -> bool:
        """Blocks for n more tokens of a running seq; while the cache is full, the policy's victim is
        preempted (even if already in this step), until seq fits or is the victim itself."""
        while not self.bm.allocate(seq, seq.num_computed_tokens + n):
            choice = self.policy_object.victim(step, step._view(seq))
            victim = self.find(choice)
            if victim is None or id(victim) not in self._running_ids:
                raise self._error("victim", step, seq.id, f"victim() chose {req_id(choice)!r}, "
                                  "which is not running")
            self._preempt(victim, step._batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: Batch):
        """Recompute preemption: drop its KV and its place in this step; it goes back to the head of the queue.
        One admitted in this same step is an admission undone: its prefix hit was never served, so uncounted."""
        self.running.remove(seq)
        self._running_ids.discard(id(seq))
        self._unplace(batch, seq)
        if seq in self._admitted:
            self.bm.undo_match(seq)
        else:
            self.bm.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.draft_token_ids = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._waiting_ids.add(id(seq))
        batch.preempted.append(seq)

    # ---- what a StepView reads while the step is built ----
    def is_running(self, seq: Sequence) -> bool:
        return id(seq) in self._running_ids

    def in_step(self, seq: Sequence) -> bool:
        return id(seq) in self._in_batch

    @property
    def step_tokens(self) -> int:
        """Tokens already in the step being built."""
        return self._batch_tokens

    def find(self, req, must: bool = False) -> Sequence | None:
        """The waiting or running sequence (of the step being built) a RequestView or id names."""
        seq = req._seq if isinstance(req, RequestView) else self._by_id.get(req) if isinstance(req, str) else None
        found = seq if seq is not None and (id(seq) in self._running_ids or id(seq) in self._waiting_ids) else None
        if found is None and must:
            raise KeyError(f"no waiting or running request {req_id(req)!r}")
        return found

    def _check_open(self, step: StepView, req) -> Sequence | None:
        if not step.open:
            raise self._error("stale_view", step, req_id(req), "this step was already handed to the engine")
        return self.find(req)

    def _error(self, rule: str, step: StepView, req: str | None, detail: str) -> PolicyError:
        return PolicyError(rule, step.index, req, detail, self.policy)

    def _undo(self, batch: Batch, waiting_before: list[Sequence]):
        """A refused step: its admissions go back to the queue where they were, holding nothing.
        Preemptions stand (their KV is gone; they wait at the head of the queue, as after any preemption);
        blocks reserved for running requests stay theirs and serve their next steps."""
        for seq in reversed(self._admitted):
            if seq in self.running:
                self.running.remove(seq)
                self.bm.undo_match(seq)
                seq.status = Status.WAITING
        victims = [s for s in self.waiting if s in batch.preempted]
        self.waiting = deque(victims + [s for s in waiting_before if s not in victims
                                        and s.status == Status.WAITING])

    def _left_out(self, batch: Batch):
        """The cause of every running reply the step left out."""
        prefills = [(s, n) for s, n in batch.items if not s.is_prefill_done]
        by, by_n = max(prefills, key=lambda item: item[1]) if prefills else (None, None)
        for s in self.running:
            if not s.is_prefill_done or id(s) in self._in_batch:
                continue
            if prefills:
                batch.left_out[s.id] = (self.policy_object.prefill_cause, by.id, by_n)
            elif len(batch.items) >= self.max_num_seqs:
                batch.left_out[s.id] = ("no_slot", None, None)
            elif self._batch_tokens >= self.token_budget:
                batch.left_out[s.id] = ("budget", None, None)
            else:
                batch.left_out[s.id] = ("policy", None, None)
