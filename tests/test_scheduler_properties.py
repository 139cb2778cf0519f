"""Model-free property test of Scheduler + BlockManager: thousands of random workloads, every step checked.

Each case draws a cache (block sizes 1-16, a few blocks more than one request needs), budgets (down to
1 token, 1 sequence), a chunk cap, and a workload of prompts that share prefixes; steps run with random
arrivals, aborts and policy or budget switches. After every schedule() the invariants that
tests/scheduler_workload.py checks (Case.check) must hold.
"""
import pytest

from tests.scheduler_workload import Case

NUM_CASES = 2000


def test_random_workloads_keep_every_invariant():
    for seed in range(NUM_CASES):
        case = Case(seed)
        try:
            case.drive()
        except AssertionError as e:
            pytest.fail(f"case {seed}: {e}")
        assert case.sched.bm.num_used == 0, f"case {seed}: blocks left in use"
        for s in case.seqs.values():
            assert s.is_finished, f"case {seed}: {s.id} never finished"
