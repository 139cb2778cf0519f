"""Scheduling policies without a model: what each step contains, in milliseconds."""
import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def make(policy, budget=16, max_seqs=8, blocks=64, block_size=4, chunk=None):
    return Scheduler(BlockManager(blocks, block_size), policy, budget, max_seqs, chunk)


def seq(n, sid):
    return Sequence(sid, sid, list(range(1000 * len(sid), 1000 * len(sid) + n)), SamplingParams(), 0.0)


def advance(sched, batch):
    """Apply a step as the engine would: count computed tokens, append a token when the prompt is done."""
    for s, n in batch.items:
        s.num_computed_tokens += n
        sched.bm.commit_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.output_token_ids.append(7)


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
    sch.set_policy(policy, 8, 8, None)
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
        sch.set_policy("fastest", 8, 8, None)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sch.set_policy("chunked", 0, 8, None)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sch.set_policy("chunked", 8, -1, None)
