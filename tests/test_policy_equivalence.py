"""The built-in policies on the policy interface give the same steps as the scheduler before policies were
objects (tests/reference_scheduler.py), on thousands of random workloads: same items, same preemptions,
same stall causes, same queues, the same physical blocks."""
import random

import pytest

from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policies import resolve
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence, Status
from tests.reference_scheduler import ReferenceScheduler

POLICIES = ("static", "continuous", "chunked")
NUM_CASES = 1500


def budgets(rng):
    return rng.choice([1, 2, 3, 5, 8, 16, 64]), rng.choice([1, 2, 3, 4, 8]), rng.choice([None, 1, 2, 3, 5])


def state(sched) -> tuple:
    bm = sched.bm
    return ([(s.id, s.num_computed_tokens, tuple(s.block_table)) for s in sched.running],
            [s.id for s in sched.waiting], list(bm.free_ids), bm.num_hit_tokens, sorted(bm.hash_to_block.items()))


def run_twins(seed: int) -> int:
    """One random workload on both schedulers in lockstep; returns the steps compared."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 8, 16])
    bases = [[rng.randrange(6) for _ in range(rng.randint(0, 3 * bs))] for _ in range(3)]
    reqs = [(f"r{i}", rng.choice(bases) + [rng.randrange(6) for _ in range(rng.randint(1, 3 * bs + 4))],
             rng.randint(1, 6)) for i in range(rng.randint(2, 12))]
    need = -(-max(len(p) + m for _, p, m in reqs) // bs)
    blocks = need + rng.choice([0, 1, 3, need // 2, need, 2 * need])
    policy, b = rng.choice(POLICIES), budgets(rng)
    twins = [ReferenceScheduler(BlockManager(blocks, bs), policy, *b),
             Scheduler(BlockManager(blocks, bs), resolve(policy), *b)]
    seqs = [{}, {}]
    pending = list(reqs)
    for step in range(3000):
        if not pending and not twins[0].has_work():
            assert not twins[1].has_work()
            return step
        if pending and rng.random() < 0.5:
            rid, prompt, m = pending.pop(0)
            for k in (0, 1):
                seqs[k][rid] = Sequence(rid, rid, list(prompt), SamplingParams(max_tokens=m), 0.0)
                twins[k].add(seqs[k][rid])
        live = [rid for rid, s in seqs[0].items() if not s.is_finished]
        if live and rng.random() < 0.03:
            rid = rng.choice(live)
            for k in (0, 1):
                twins[k].remove(seqs[k][rid])
                seqs[k][rid].status = Status.ABORTED
        if rng.random() < 0.04:
            p, b = rng.choice(POLICIES), budgets(rng)
            for t in twins:
                t.set_policy(p if isinstance(t, ReferenceScheduler) else resolve(p), *b)
        batches = [t.schedule() for t in twins]
        plans = [([(s.id, n) for s, n in bt.items], [s.id for s in bt.preempted], bt.left_out) for bt in batches]
        assert plans[0] == plans[1], f"case {seed} step {step} ({twins[0].policy}): {plans[0]} != {plans[1]}"
        assert state(twins[0]) == state(twins[1]), f"case {seed} step {step}: the queues or blocks differ"
        for k in (0, 1):
            tokens = [sum(s.all_token_ids) % 6 for s, n in batches[k].items
                      if s.num_computed_tokens + n == s.num_tokens]
            for s, _ in twins[k].update(batches[k], tokens, 0.0):
                if s.num_output_tokens >= s.params.max_tokens:
                    twins[k].remove(s)
                    s.status = Status.FINISHED
    raise AssertionError(f"case {seed} did not finish")


def test_builtin_policies_give_the_reference_steps():
    steps = 0
    for seed in range(NUM_CASES):
        try:
            steps += run_twins(seed)
        except AssertionError as e:
            pytest.fail(str(e))
    assert steps > 10 * NUM_CASES           # the cases really ran (preemptions, policy switches, prefix hits)
