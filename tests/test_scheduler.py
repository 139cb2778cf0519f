"""Scheduling policies without a model: what each step contains, in milliseconds."""
import pytest

from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policies import resolve
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence


def make(policy, budget=16, max_seqs=8, blocks=64, block_size=4, chunk=None):
    return Scheduler(BlockManager(blocks, block_size), resolve(policy), budget, max_seqs, chunk)


def seq(n, sid):
    return Sequence(sid, sid, list(range(1000 * len(sid), 1000 * len(sid) + n)), SamplingParams(), 0.0)


def advance(sched, batch, token=7):
    """Apply a step's outcome: the token each sequence that completed its known tokens samples."""
    done = [s for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens]
    return sched.update(batch, [token] * len(done), 0.0)


def plan(batch):
    return [(s.id, n) for s, n in batch.items]


def test_chunked_decodes_first_then_chunks_fill_the_budget():
    sch = make("chunked", budget=16)
    a, b = seq(4, "a"), seq(40, "bb")
    sch.add(a)
    advance(sch, sch.schedule())                  # a prefilled
    sch.add(b)
    batch = sch.schedule()
    assert plan(batch) == [("a", 1), ("bb", 15)]  # a's decode, then 15 prompt tokens of b
    advance(sch, batch)
    assert plan(sch.schedule()) == [("a", 1), ("bb", 15)]


def test_continuous_prefills_whole_prompt_and_decodes_wait():
    sch = make("continuous", budget=16)
    a, b = seq(4, "a"), seq(40, "bb")
    sch.add(a)
    advance(sch, sch.schedule())
    sch.add(b)
    batch = sch.schedule()
    assert plan(batch) == [("bb", 40)]            # a whole prompt over the budget runs alone: the stall
    advance(sch, batch)
    assert plan(sch.schedule()) == [("a", 1), ("bb", 1)]


def test_continuous_packs_prompts_under_the_budget():
    sch = make("continuous", budget=16)
    for sid in ("a", "bb", "ccc"):
        sch.add(seq(6, sid))
    assert plan(sch.schedule()) == [("a", 6), ("bb", 6)]   # the third would pass the budget


def test_static_batch_admits_nobody_until_it_is_done():
    sch = make("static", budget=64, max_seqs=2)
    a, b, c = seq(4, "a"), seq(4, "bb"), seq(4, "ccc")
    for s in (a, b, c):
        sch.add(s)
    batch = sch.schedule()
    assert plan(batch) == [("a", 4), ("bb", 4)]
    advance(sch, batch)
    sch.remove(a)                                  # a finishes early; its slot stays idle
    batch = sch.schedule()
    assert plan(batch) == [("bb", 1)]
    advance(sch, batch)
    sch.remove(b)
    assert plan(sch.schedule()) == [("ccc", 4)]   # the next batch forms only now


def test_chunk_cap_limits_one_request():
    sch = make("chunked", budget=32, chunk=8)
    sch.add(seq(20, "a"))
    assert plan(sch.schedule()) == [("a", 8)]


def test_max_num_seqs_caps_the_step():
    sch = make("chunked", budget=100, max_seqs=2)
    for sid in ("a", "bb", "ccc"):
        sch.add(seq(3, sid))
    assert [sid for sid, _ in plan(sch.schedule())] == ["a", "bb"]


def test_preemption_frees_the_newest_and_requeues_it_first():
    sch = make("chunked", budget=64, blocks=4, block_size=4, max_seqs=4)
    a, b = seq(7, "a"), seq(7, "bb")              # 2 blocks each: the cache is full after both prefill
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert plan(batch) == [("a", 7), ("bb", 7)]
    advance(sch, batch)
    batch = sch.schedule()
    advance(sch, batch)                            # positions 7 fit in the second block
    batch = sch.schedule()                         # position 8 needs a third block for a: b is preempted
    assert plan(batch) == [("a", 1)]
    assert [s.id for s in batch.preempted] == ["bb"]
    assert sch.waiting[0] is b and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1


def test_admission_waits_for_room_for_the_whole_prompt():
    sch = make("chunked", budget=8, blocks=4, block_size=4)
    sch.add(seq(30, "a"))                          # needs 8 blocks, the cache has 4
    assert plan(sch.schedule()) == []


@pytest.mark.parametrize("policy", ["static", "continuous", "chunked"])
def test_switching_policy_mid_flight_loses_nothing(policy):
    sch = make("chunked", budget=8)
    seqs = [seq(10 + i, "x" * (i + 1)) for i in range(4)]
    for s in seqs:
        sch.add(s)
    advance(sch, sch.schedule())
    sch.set_policy(resolve(policy), 8, 8, None)
    for _ in range(40):
        batch = sch.schedule()
        advance(sch, batch)
        for s in list(sch.running):
            if s.num_output_tokens >= 3:
                sch.remove(s)
    assert not sch.running and not sch.waiting
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert sch.bm.num_used == 0


def test_bad_policy_and_budgets_are_rejected():
    sch = make("chunked")
    with pytest.raises(ValueError, match="policy"):
        sch.set_policy(resolve("fastest"), 8, 8, None)
    with pytest.raises(TypeError, match="Policy object"):
        sch.set_policy("chunked", 8, 8, None)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sch.set_policy(resolve("chunked"), 0, 8, None)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sch.set_policy(resolve("chunked"), 8, -1, None)


def test_readmitted_request_that_is_really_a_decode_goes_first():
    """A preempted request comes back with all but its newest token in the prefix cache: a decode at
    admission. It must still precede the prefill chunks (the runner needs decodes first)."""
    sch = make("chunked", budget=16, blocks=32, block_size=2, chunk=8)
    w = Sequence("w", "w", [1, 2, 3, 4, 9], SamplingParams(), 0.0)
    sch.add(w)
    advance(sch, sch.schedule())
    sch.remove(w)                                  # its blocks [1 2] [3 4] stay in the prefix cache
    p = seq(40, "p")
    sch.add(p)
    advance(sch, sch.schedule())                   # p is a prompt under way
    x = Sequence("x", "x", [1, 2, 3, 4], SamplingParams(), 0.0, output_token_ids=[5])
    sch.add(x)                                     # as after a preemption: 4 of its 5 tokens are cached
    batch = sch.schedule()
    assert plan(batch) == [("x", 1), ("p", 8)]
    assert x.is_prefill_done and x.num_cached_tokens == 4


def test_decodes_take_turns_when_the_budget_is_one_token():
    sch = make("chunked", budget=8, max_seqs=8)
    for sid in ("a", "bb", "ccc"):
        sch.add(seq(2, sid))
    advance(sch, sch.schedule())                   # three replies under way
    sch.set_policy(resolve("chunked"), 1, 8, None)          # the lecture's smallest budget
    served = []
    for _ in range(6):
        batch = sch.schedule()
        served.append(plan(batch)[0][0])
        advance(sch, batch)
    assert served == ["a", "bb", "ccc", "a", "bb", "ccc"]


def test_non_finite_logits_publish_nothing_to_the_prefix_cache():
    sch = make("chunked", budget=16, block_size=4)
    a = seq(9, "a")
    sch.add(a)
    out = advance(sch, sch.schedule(), token=None)
    assert out == [(a, None)] and a.num_output_tokens == 0
    assert sch.bm.num_cached == 0                  # its two full blocks were not published


def test_a_step_that_preempts_admits_nobody():
    sch = make("chunked", budget=64, blocks=4, block_size=4, max_seqs=4)
    a, b = seq(7, "a"), seq(7, "bb")
    sch.add(a)
    sch.add(b)
    advance(sch, sch.schedule())
    advance(sch, sch.schedule())
    sch.add(seq(1, "c"))                           # would fit once b's blocks are freed
    batch = sch.schedule()
    assert [s.id for s in batch.preempted] == ["bb"]
    assert plan(batch) == [("a", 1)] and [s.id for s in sch.waiting] == ["bb", "c"]
