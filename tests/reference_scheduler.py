"""The scheduler as it was before policies became objects: the reference the built-in policies are tested
against, step for step (tests/test_policy_equivalence.py). Kept verbatim apart from this docstring, the
class name and one change marked THE ONE CHANGE in _admit; not used by the engine.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import check_budgets, check_scheduler_policy
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.sequence import Sequence, Status


@dataclass
class Batch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # why each running decode was left out, decided where it was left out: seq id -> (cause, by, by_tokens)
    left_out: dict[str, tuple[str, str | None, int | None]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __contains__(self, seq: Sequence) -> bool:
        return any(s is seq for s, _ in self.items)

    def remove(self, seq: Sequence):
        self.items = [(s, n) for s, n in self.items if s is not seq]


class ReferenceScheduler:
    def __init__(self, block_manager: BlockManager, policy: str, max_num_batched_tokens: int,
                 max_num_seqs: int, max_prefill_chunk: int | None = None):
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # admission order: the newest is preempted first
        self.num_steps = 0
        self.set_policy(policy, max_num_batched_tokens, max_num_seqs, max_prefill_chunk)

    def set_policy(self, policy: str, max_num_batched_tokens: int, max_num_seqs: int,
                   max_prefill_chunk: int | None):
        check_scheduler_policy(policy)
        check_budgets(max_num_batched_tokens, max_num_seqs, max_prefill_chunk)
        self.policy = policy
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_chunk = max_prefill_chunk

    def settings(self) -> dict:
        return {"policy": self.policy, "max_num_batched_tokens": self.token_budget,
                "max_num_seqs": self.max_num_seqs, "max_prefill_chunk": self.max_prefill_chunk}

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
    def schedule(self) -> Batch:
        batch = Batch()
        if self.policy == "chunked":
            self._schedule_chunked(batch)
        elif self.policy == "continuous":
            self._schedule_continuous(batch)
        else:
            self._schedule_static(batch)
        in_batch = {id(s) for s, _ in batch.items}
        for seq in self.running:                # a re-admitted decode left out holds what it computed
            if id(seq) not in in_batch:
                self.bm.trim(seq, seq.num_computed_tokens)
        # decodes first: the runner lays out one token per decode, then the chunks (stable: order kept)
        batch.items.sort(key=lambda item: not item[0].is_prefill_done)
        for seq, _ in batch.items:
            seq.last_scheduled = self.num_steps
        self.num_steps += 1
        return batch

    def update(self, batch: Batch, tokens: list[int | None], now: float) -> list[tuple[Sequence, int | None]]:
        """After the forward pass: count the computed tokens, publish full blocks, append the sampled tokens.

        tokens: one per sequence whose step completed its known tokens, in batch order; None where the
        logits were non-finite (that sequence publishes nothing to the prefix cache: its KV is suspect).
        Returns (sequence, token) for each of those; ending a request is the engine's call.
        """
        sampled, out = iter(tokens), []
        for seq, n in batch.items:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:      # a chunk that did not finish the prompt
                self.bm.commit_full_blocks(seq)
                continue
            token = next(sampled)
            if token is not None:
                self.bm.commit_full_blocks(seq)
                seq.append_token(token, now)
            out.append((seq, token))
        return out

    def _schedule_chunked(self, batch: Batch):
        # decode first: running requests must never wait for a prompt
        self._add_decodes(batch)
        # then prompts already under way, oldest first, then new ones, in chunks that fill the leftover budget
        for seq in list(self.running):
            if self._full(batch):
                return
            if seq.is_prefill_done or seq not in self.running:
                continue
            n = self._chunk(seq, batch)
            if self._reserve(seq, n, batch):
                batch.items.append((seq, n))
        while not self._full(batch) and self._can_admit(batch):
            seq = self.waiting[0]
            n = self._admit(seq, lambda s: self._chunk(s, batch))
            if n == 0:
                return
            batch.items.append((seq, n))

    def _schedule_continuous(self, batch: Batch):
        # prefill first: any prompt that fits runs now, whole; decodes wait for it
        self._add_whole_prefills(batch)
        while self._can_admit(batch):
            seq = self.waiting[0]
            n = self._admit(seq, lambda s: s.num_uncomputed_tokens,
                            fits=lambda n: not batch.items or n <= self._budget_left(batch))
            if n == 0:
                break
            batch.items.append((seq, n))
        if any(not s.is_prefill_done for s, _ in batch.items):
            # a re-admitted request that is really a decode waits with the other decodes
            batch.items = [(s, n) for s, n in batch.items if not s.is_prefill_done]
            self._prefill_took(batch, "prefill")
        else:
            self._add_decodes(batch)

    def _schedule_static(self, batch: Batch):
        if not self.running:                     # the last batch is done: form the next one
            # as many whole prompts as the budget holds (the first always goes), so the batch is
            # prefilled in one step and no member waits for another member's prompt
            tokens = 0
            while self.waiting and len(self.running) < self.max_num_seqs:
                n = self._admit(self.waiting[0], lambda s: s.num_uncomputed_tokens,
                                fits=lambda n: not self.running or tokens + n <= self.token_budget)
                if n == 0:
                    break
                tokens += n
        # prefill every member before anyone decodes; then decode until all have finished
        self._add_whole_prefills(batch)
        if batch.items:
            self._prefill_took(batch, "static_batch")
        else:
            self._add_decodes(batch)

    # ---- helpers ----
    def _budget_left(self, batch: Batch) -> int:
        return self.token_budget - batch.num_tokens

    def _full(self, batch: Batch) -> bool:
        return self._budget_left(batch) <= 0 or len(batch.items) >= self.max_num_seqs

    def _add_whole_prefills(self, batch: Batch):
        """Running prompts not yet prefilled, each whole, packed under the budget (the first always goes)."""
        for seq in list(self.running):
            if seq.is_prefill_done or seq not in self.running or len(batch.items) >= self.max_num_seqs:
                continue
            n = seq.num_uncomputed_tokens
            if batch.items and n > self._budget_left(batch):
                break
            if self._reserve(seq, n, batch):
                batch.items.append((seq, n))

    def _add_decodes(self, batch: Batch):
        # left out longest first (ties: admission order): with fewer slots than decodes, they take turns
        ready = sorted((s for s in self.running if s.is_prefill_done and s not in batch),
                       key=lambda s: s.last_scheduled)
        for seq in ready:
            if self._full(batch):
                cause = "no_slot" if len(batch.items) >= self.max_num_seqs else "budget"
                for s in ready:
                    if s in self.running and s not in batch:
                        batch.left_out.setdefault(s.id, (cause, None, None))
                break
            if seq in self.running and self._reserve(seq, 1, batch):
                batch.items.append((seq, 1))

    def _prefill_took(self, batch: Batch, cause: str):
        """Whole prompts took this step: every ready decode waits, blamed on the largest prefill."""
        seq, n = max(batch.items, key=lambda item: item[1])
        for s in self.running:
            if s.is_prefill_done and s not in batch:
                batch.left_out.setdefault(s.id, (cause, seq.id, n))

    def _chunk(self, seq: Sequence, batch: Batch) -> int:
        n = min(seq.num_uncomputed_tokens, self._budget_left(batch))
        return min(n, self.max_prefill_chunk) if self.max_prefill_chunk else n

    def _can_admit(self, batch: Batch) -> bool:
        # a step that preempted admits nobody: the memory it freed was needed by those already running
        return (bool(self.waiting) and not batch.preempted and len(self.running) < self.max_num_seqs
                and len(batch.items) < self.max_num_seqs)

    def _admit(self, seq: Sequence, size, fits=lambda n: True) -> int:
        """Move the head of the queue to running with its first chunk's blocks. 0 = it must wait.

        Admission needs room for the whole remaining prompt, not just the first
        chunk, so that admitted prompts are not preempted again and again.
        """
        if self.bm.blocks_needed(seq, seq.num_tokens) > self.bm.num_free:
            return 0
        # THE ONE CHANGE: the size is read from a peek at the prefix cache before matching, so a refused
        # admission leaves the free list's LRU order as it was (the original matched, then undid the match,
        # which moved the matched free blocks to the recent end of the free list)
        seq.num_computed_tokens = self.bm.cached_prefix_tokens(seq)
        n = size(seq)
        seq.num_computed_tokens = 0
        if n <= 0 or not fits(n):
            return 0
        self.bm.match_prefix(seq)               # a waiting sequence holds no blocks and has computed nothing
        if not self.bm.allocate(seq, seq.num_computed_tokens + n):
            self.bm.undo_match(seq)             # waiting sequences hold no blocks
            return 0
        self.waiting.popleft()
        seq.status = Status.RUNNING
        self.running.append(seq)
        return n

    def _reserve(self, seq: Sequence, n: int, batch: Batch) -> bool:
        """Blocks for n more tokens of a running seq; while the cache is full, the newest admitted request
        is preempted (even if already in this step), until seq fits or is the newest itself."""
        while not self.bm.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: Batch):
        """Recompute preemption: drop its KV and its place in this step; it goes back to the head of the queue."""
        self.running.remove(seq)
        batch.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
