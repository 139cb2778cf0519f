"""The cache's live settings, model-free: prefix caching switched on and off, and the `max_kv_blocks` cap
raised and lowered (below the blocks in use too), between the steps of random scheduler workloads.

Every step keeps tests/scheduler_workload.py's invariants (ref counts equal to the holders, no waiting
request holding a block, hits counted only for admissions that held) and these: the hash table names
only blocks that hold its hash; with caching off nothing is matched and nothing is published; blocks in
use grow only while they fit under the cap. Every request finishes and every block comes back.
"""
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policies import resolve
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence, Status
from tests.scheduler_workload import Case


class CacheCase(Case):
    """A random workload whose cache settings also change, drawn from a second generator (the workload's
    own draws stay those of Case(seed))."""

    def __init__(self, seed: int, settings_seed: int):
        super().__init__(seed)
        self.knobs = random.Random(settings_seed)
        bm = self.sched.bm
        self.need = max(bm.blocks_for(len(p) + m) for _, p, m in self.requests)   # the most one request holds
        self.changes = 0

    def vary(self, step: int):
        rng, sched, bm = self.knobs, self.sched, self.sched.bm
        if rng.random() < 0.15:
            cap = rng.choice([None, self.need, self.need, rng.randint(self.need, bm.num_blocks), bm.num_blocks])
            caching = rng.choice([None, True, False])
            before = (bm.max_kv_blocks, bm.enable_prefix_caching)
            sched.set_cache(caching, cap)
            assert bm.max_kv_blocks == cap and bm.capacity == (cap or bm.num_blocks)
            assert bm.enable_prefix_caching == (before[1] if caching is None else caching)
            if caching is False:
                assert not bm.hash_to_block and all(bm.blocks[b].hash is None for b in bm.free_ids)
            self.changes += 1
        elif rng.random() < 0.05:          # a bad value changes nothing and says why
            bad = rng.choice([0, -1, bm.num_blocks + 1, True, 2.5, "8"])
            before = sched.settings()
            with pytest.raises(ValueError, match="max_kv_blocks"):
                sched.set_cache(rng.choice([None, False]), bad)
            assert sched.settings() == before
        self.used_before = bm.num_used

    def check(self, batch, before, step):
        super().check(batch, before, step)
        bm = self.sched.bm
        for h, b in bm.hash_to_block.items():
            assert bm.blocks[b].hash == h, f"step {step}: the table names block {b} for a hash it does not hold"
        if not bm.enable_prefix_caching:
            assert not bm.hash_to_block, f"step {step}: caching is off but the table holds entries"
            newcomers = [s for s, _ in batch.items if s.num_cached_tokens and s not in before["running"]]
            assert not newcomers, f"step {step}: a hit with caching off"
        if bm.num_used > bm.capacity:       # over a lowered cap: nothing more is taken until it fits again
            assert bm.num_used <= self.used_before, (f"step {step}: {bm.num_used} blocks in use, cap "
                                                     f"{bm.capacity}, {self.used_before} before the step")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), settings_seed=st.integers(0, 2**31))
@example(seed=4303, settings_seed=4303)     # a request re-admitted with a prefix hit and preempted in that same step
def test_live_cache_settings_keep_every_invariant(seed, settings_seed):
    case = CacheCase(seed, settings_seed)
    case.drive()
    assert case.sched.bm.num_used == 0, "blocks left in use"
    for s in case.seqs.values():
        assert s.is_finished, f"{s.id} never finished"


def one_request_case(num_blocks=8, bs=4, prompt=12, max_tokens=4):
    sched = Scheduler(BlockManager(num_blocks, bs), resolve("chunked"), 64, 4)
    seq = Sequence("r0", "r0", list(range(prompt)), SamplingParams(max_tokens=max_tokens), 0.0)
    sched.add(seq)
    return sched, seq


def test_a_cap_below_what_a_live_request_needs_is_refused_by_name():
    sched, seq = one_request_case()             # 12 + 4 tokens in blocks of 4: 4 blocks
    with pytest.raises(ValueError, match=r"max_kv_blocks=3 is below the 4 blocks request 'r0' needs"):
        sched.set_cache(None, 3)
    sched.set_cache(False, 4)
    assert sched.settings()["max_kv_blocks"] == 4 and sched.settings()["enable_prefix_caching"] is False


def test_a_new_request_larger_than_the_cap_is_refused_by_name():
    sched, _ = one_request_case()
    sched.set_cache(None, 5)
    sched.check_fits(16, 4)                     # 20 tokens: 5 blocks, fits
    with pytest.raises(ValueError, match=r"needs 6 KV blocks .* capped at 5 blocks \(max_kv_blocks\)"):
        sched.check_fits(17, 4)


def test_lowering_the_cap_below_the_blocks_in_use_preempts_the_newest_and_loses_nothing():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, resolve("chunked"), 64, 4)
    seqs = [Sequence(f"r{i}", f"r{i}", [i] * 7, SamplingParams(max_tokens=6), 0.0) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()                    # all three prompts (7 tokens: 2 blocks each)
    sched.update(batch, [1, 1, 1], 0.0)
    assert bm.num_used == 6
    sched.set_cache(None, 5)                    # below the 6 in use: 13 tokens is 4 blocks, so r0 alone fits
    preempted = []
    for _ in range(200):
        if not sched.has_work():
            break
        batch = sched.schedule()
        preempted += [s.id for s in batch.preempted]
        assert bm.num_used <= max(5, 6), bm.num_used
        out = sched.update(batch, [1] * sum(1 for s, n in batch.items if s.num_computed_tokens + n >= s.num_tokens),
                           0.0)
        for s, _ in out:
            if s.num_output_tokens >= s.params.max_tokens:
                sched.remove(s)
                s.status = Status.FINISHED
    assert preempted and preempted[0] == "r2", preempted      # the newest goes first (vLLM's rule)
    assert all(s.is_finished and s.num_output_tokens == 6 for s in seqs)
    assert bm.num_used == 0


def test_switching_prefix_caching_off_drops_the_table_but_not_the_holders():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, resolve("chunked"), 64, 4)
    a = Sequence("a", "a", list(range(9)), SamplingParams(max_tokens=2), 0.0)
    sched.add(a)
    sched.update(sched.schedule(), [5], 0.0)
    assert bm.num_cached == 2                   # two full blocks published
    b = Sequence("b", "b", list(range(9)), SamplingParams(max_tokens=2), 0.0)
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 8 and [bm.blocks[i].ref_count for i in b.block_table[:2]] == [2, 2]
    sched.set_cache(False)
    assert bm.num_cached == 0 and [bm.blocks[i].ref_count for i in b.block_table[:2]] == [2, 2]
    c = Sequence("c", "c", list(range(9)), SamplingParams(max_tokens=2), 0.0)
    assert bm.cached_prefix_tokens(c) == 0      # nothing is found any more
    for s in (a, b):
        sched.remove(s)
    assert bm.num_used == 0 and bm.num_free == 8
