"""Paged KV cache bookkeeping: which physical block holds which tokens.

The cache is a pool of fixed-size blocks. A sequence's block table maps its
logical block i (tokens i*block_size .. (i+1)*block_size-1) to a physical
block. Blocks are taken on demand as tokens are computed and given back when a
sequence finishes, is aborted or is preempted.

Prefix caching: a block that is full gets a hash chained from its tokens and
the hash of the block before it, so equal hashes mean equal prefixes. A new
sequence whose prompt starts with cached blocks reuses them (ref_count > 1)
instead of computing them again. A freed block keeps its hash until the block
is handed out for something else, so a later request can still hit it.

A hit is checked, not trusted: the block must hold the same tokens and have been
computed after the very block matched just before it (its parent, by id and
generation), so a 64-bit hash collision can never serve one user another
user's KV. Hit statistics count only admissions that held (undo_match takes an
undone one back).

Both can change live. Prefix caching switched off (set_prefix_caching) drops the hash table: nothing is
matched or published from then on, and free blocks forget their content; blocks still held stay with
their holders (their ref counts are untouched) and go back to the free list as any block does. The
capacity (set_capacity, the `max_kv_blocks` setting) caps the blocks in use below the blocks allocated:
`num_free` is what is left under it, so admissions wait and running requests that need a block preempt
(the scheduler's rule) until the blocks in use fit again; nothing already held is taken away.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.scheduling.sequence import Sequence


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids", "parent", "gen")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent: tuple[int, int] | None = None   # (id, gen) of the block before it when it was computed
        self.gen = 0                                 # bumped each time the block is handed out again


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.max_kv_blocks: int | None = None   # the live cap on blocks in use; None: all of them
        self.map_due = False         # the cache changed beyond what `log` says (a reset): send the whole map
        self.num_hit_tokens = 0      # prefix-cache statistics: tokens served to admitted sequences
        # what changed, for the KV map (None: not kept): (op, block id, request id); op is `alloc` (taken,
        # its cached content evicted), `share` (a prefix hit), `free` (the request let go), `commit` (now cached)
        self.log: list[tuple[str, int, str]] | None = None

    def _note(self, op: str, block_id: int, seq: Sequence):
        if self.log is not None:
            self.log.append((op, block_id, seq.id))

    # ---- sizes ----
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        """Blocks that may be in use at once."""
        return self.num_blocks if self.max_kv_blocks is None else self.max_kv_blocks

    @property
    def num_free(self) -> int:
        """Blocks that may still be taken: free ones, under the capacity."""
        return max(0, self.capacity - self.num_used)

    @property
    def num_used(self) -> int:
        """Blocks some request holds (ref_count > 0); above the capacity after it was lowered."""
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def unpublished_blocks(self, seq) -> list[int]:
        """seq's blocks not in the prefix cache: only seq holds them (sharing goes through the cache)."""
        return [b for b in seq.block_table if self.blocks[b].hash is None]

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its table covers num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # ---- live settings ----
    def check_capacity(self, num_blocks: int | None) -> int:
        """The capacity a `max_kv_blocks` value gives, or a ValueError naming what is wrong with it."""
        if num_blocks is None:
            return self.num_blocks
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= self.num_blocks:
            raise ValueError(f"max_kv_blocks must be an integer from 1 to the {self.num_blocks} blocks allocated "
                             f"(or null: all of them), got {num_blocks!r}")
        return num_blocks

    def set_capacity(self, num_blocks: int | None):
        """Cap the blocks in use at num_blocks (None: all of them), from the next allocation on."""
        self.check_capacity(num_blocks)
        self.max_kv_blocks = num_blocks

    def set_prefix_caching(self, enabled: bool):
        """Switch the prefix cache on or off; off drops its table and the content of free blocks."""
        if not isinstance(enabled, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {enabled!r}")
        if not enabled:
            self.reset_prefix_cache()
        self.enable_prefix_caching = enabled

    def reset_prefix_cache(self):
        """Forget every cached prefix (vLLM's reset_prefix_cache): no later request hits what came before.
        Held blocks keep their hash, so they still count as published (shared through the cache, never
        trimmed); the table no longer finds them, and they are evicted like any block once free."""
        self.hash_to_block.clear()
        self.map_due = True
        for block_id in self.free_ids:
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.parent = None, None, None

    # ---- allocation ----
    def _take(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)   # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None:                        # evict its cached content
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.parent = None, None, None
        block.gen += 1
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's table to cover num_tokens tokens. All or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
            self._note("alloc", seq.block_table[-1], seq)
        return True

    def trim(self, seq: Sequence, num_tokens: int):
        """Shrink seq's table to the blocks that cover num_tokens tokens (rejected draft tokens' KV is
        rolled back: the blocks taken for them alone go back; they were never published, so never shared)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            assert block.hash is None and block.ref_count == 1, "a draft's block is the request's own"
            self._note("free", block_id, seq)
            block.ref_count = 0
            self.free_ids[block_id] = None

    def free(self, seq: Sequence):
        for block_id in reversed(seq.block_table):        # tail first: the prefix stays cached longest
            block = self.blocks[block_id]
            self._note("free", block_id, seq)
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    # ---- prefix cache ----
    def _prefix_hits(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block id, hash) of the cached blocks holding seq's leading tokens, in order; nothing is taken.

        At least one token is left to compute, since its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return []
        tokens, bs = seq.all_token_ids, self.block_size
        prev, parent, hits = None, None, []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = self._hash(prev, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent != parent:
                break                                     # a hash collision, not our prefix
            hits.append((block_id, h))
            prev, parent = h, (block_id, block.gen)
        return hits

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting seq the prefix cache would serve if it were admitted now (a policy's peek)."""
        return len(self._prefix_hits(seq)) * self.block_size

    def match_prefix(self, seq: Sequence) -> int:
        """At admission: reuse cached blocks that hold seq's leading tokens.
        Returns the number of tokens served from the cache."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id, h in self._prefix_hits(seq):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
            self._note("share", block_id, seq)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        hit = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = hit
        self.num_hit_tokens += hit
        return hit

    def undo_match(self, seq: Sequence):
        """An admission that did not go ahead: give the matched blocks back, uncount the hit."""
        self.num_hit_tokens -= seq.num_cached_tokens
        self.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    @staticmethod
    def _hash(prev: int | None, chunk: tuple[int, ...]) -> int:
        return hash((prev, chunk))

    def commit_full_blocks(self, seq: Sequence, upcoming: list[int] = ()):
        """After a step: publish the hashes of blocks that became full. upcoming: tokens about to join
        the sequence whose KV this step computed (a verified decode's accepted drafts)."""
        if not self.enable_prefix_caching:
            return
        bs, num_full = self.block_size, seq.num_computed_tokens // self.block_size
        if len(seq.block_hashes) >= num_full:
            return
        tokens = seq.all_token_ids + list(upcoming)
        for i in range(len(seq.block_hashes), num_full):
            block = self.blocks[seq.block_table[i]]
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = self._hash(prev, chunk)
            seq.block_hashes.append(h)
            if block.hash is None:
                parent = self.blocks[seq.block_table[i - 1]] if i else None
                block.hash, block.token_ids = h, chunk
                block.parent = (parent.id, parent.gen) if parent else None
                self.hash_to_block.setdefault(h, block.id)
                self._note("commit", block.id, seq)

    # ---- disaggregation: a sequence's KV leaves one engine and joins another (engine/disagg/router.py) ----
    def export_blocks(self, seq: Sequence) -> list[int]:
        """The blocks holding seq's computed tokens, in table order: copy them out, then free(seq)."""
        return seq.block_table[:-(-seq.num_computed_tokens // self.block_size)]

    def import_blocks(self, seq: Sequence, num_tokens: int) -> list[int] | None:
        """Fresh blocks for a sequence whose first num_tokens tokens were computed elsewhere: its table
        (copy the KV in), or None when the cache lacks room (nothing taken). Full blocks are published
        to the prefix cache, as if computed here."""
        assert not seq.block_table, "an imported sequence arrives without blocks"
        if not self.allocate(seq, num_tokens):
            return None
        seq.num_computed_tokens = num_tokens
        self.commit_full_blocks(seq)
        return seq.block_table
