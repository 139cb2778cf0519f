"""Paged KV bookkeeping without a model: allocation, freeing, prefix reuse and eviction."""
from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.sequence import Sequence


def seq(tokens, sid="s"):
    return Sequence(sid, sid, list(tokens), SamplingParams(), 0.0)


def compute(bm, s, n):
    """What the engine does after a forward pass over n more tokens."""
    assert bm.allocate(s, s.num_computed_tokens + n)
    s.num_computed_tokens += n
    bm.commit_full_blocks(s)


def test_allocate_on_demand_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.allocate(s, 3) and len(s.block_table) == 1
    assert bm.allocate(s, 10) and len(s.block_table) == 3
    assert bm.num_used == 3
    assert not bm.allocate(s, 100) and len(s.block_table) == 3   # all or nothing
    bm.free(s)
    assert bm.num_used == 0 and s.block_table == []


def test_prefix_blocks_are_shared_with_refcounts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(12)) + [100], "a")
    compute(bm, a, 13)
    b = seq(list(range(12)) + [200, 201], "b")
    hit = bm.match_prefix(b)
    assert hit == 12 and b.num_computed_tokens == 12
    assert b.block_table == a.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in b.block_table)
    bm.free(a)
    assert bm.num_used == 3                        # still held by b
    bm.free(b)
    assert bm.num_used == 0 and bm.num_cached == 3   # freed, but still cached


def test_match_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8), "a")
    compute(bm, a, 8)
    bm.free(a)
    b = seq(range(8), "b")                         # identical prompt: its last token must still run
    assert bm.match_prefix(b) == 4


def test_different_prefix_does_not_match():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    compute(bm, a, 9)
    b = seq([9, 2, 3, 4, 5, 6, 7, 8, 9], "b")      # same second block, different first: chained hash differs
    assert bm.match_prefix(b) == 0


def test_freed_cached_blocks_are_evicted_lru_when_needed():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq(range(5), "a")
    compute(bm, a, 5)
    bm.free(a)
    assert bm.num_cached == 2
    big = seq(range(100, 108), "big")
    assert bm.allocate(big, 8)                     # takes every block, evicting the cached ones
    assert bm.num_cached == 0 and bm.num_free == 0
    c = seq(range(5), "c")
    assert bm.match_prefix(c) == 0


def test_no_prefix_caching_switch():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(9), "a")
    compute(bm, a, 9)
    assert bm.num_cached == 0
    assert bm.match_prefix(seq(range(9), "b")) == 0


class CollidingBlockManager(BlockManager):
    """Every block's hash ignores its parent: the worst case of a 64-bit collision, on demand."""

    @staticmethod
    def _hash(prev, chunk):
        return hash(chunk)


def test_a_hash_collision_never_serves_another_prefix():
    bm = CollidingBlockManager(num_blocks=16, block_size=4)
    other = seq([0, 0, 0, 0, 5, 6, 7, 8, 9], "other")      # its second block: 5 6 7 8 after 0 0 0 0
    compute(bm, other, 9)
    mine = seq([1, 2, 3, 4, 9, 9, 9, 9, 1], "mine")        # a cached first block 1 2 3 4
    compute(bm, mine, 9)
    bm.free(other)
    bm.free(mine)
    asker = seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "asker")      # block 2's hash collides with other's block 2
    assert bm.match_prefix(asker) == 4                     # its first block only: the parent check refuses


def test_undone_match_is_not_counted_as_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(9), "a")
    compute(bm, a, 9)
    b = seq(range(9), "b")
    assert bm.match_prefix(b) == 8 and bm.num_hit_tokens == 8
    bm.undo_match(b)
    assert bm.num_hit_tokens == 0 and b.block_table == [] and b.num_computed_tokens == 0
    assert all(bm.blocks[i].ref_count == 1 for i in a.block_table)
