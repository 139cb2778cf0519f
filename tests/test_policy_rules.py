"""Each rule of engine/scheduling/scheduler.py broken by a purposely bad policy: a PolicyError naming the rule, the step
and the request; the step is undone, no block leaks, and the requests finish under a good policy."""
import pytest

from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policies import resolve
from engine.scheduling.policy import RULES, Policy, PolicyError
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence, Status


def seq(n: int, sid: str, start: int = 0) -> Sequence:
    return Sequence(sid, sid, list(range(start, start + n)), SamplingParams(max_tokens=3), 0.0)


def advance(sched, batch):
    done = [s for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens]
    for s, _ in sched.update(batch, [7] * len(done), 0.0):
        if s.num_output_tokens >= s.params.max_tokens:
            sched.remove(s)
            s.status = Status.FINISHED


def setup(blocks=64, budget=16, max_seqs=8):
    """Two replies under way (a, b) and two prompts waiting (c, d)."""
    sched = Scheduler(BlockManager(blocks, 4), resolve("chunked"), budget, max_seqs)
    seqs = [seq(4, "a"), seq(4, "b", 100)]
    for s in seqs:
        sched.add(s)
    advance(sched, sched.schedule())
    for s in (seq(6, "c", 200), seq(5, "d", 300)):
        seqs.append(s)
        sched.add(s)
    return sched, seqs


def check_blocks(sched, seqs):
    holders = {}
    for s in sched.running:
        for b in s.block_table:
            holders[b] = holders.get(b, 0) + 1
    for s in sched.waiting:
        assert not s.block_table and s.num_computed_tokens == 0, f"waiting {s.id} holds blocks"
        assert s.status == Status.WAITING
    for block in sched.bm.blocks:
        assert block.ref_count == holders.get(block.id, 0), f"block {block.id} leaked"
    assert {s.id for s in (*sched.running, *sched.waiting)} == {s.id for s in seqs if not s.is_finished}


class Bad(Policy):
    def __init__(self, name, fn, victim=None):
        self.name, self.fn, self._victim = name, fn, victim

    def schedule(self, step):
        return self.fn(step)

    def victim(self, step, needy):
        return self._victim(step, needy) if self._victim else super().victim(step, needy)


def admit_c_then(bad):
    """Admit c (so the undo has something to undo), then break a rule."""
    def fn(step):
        c = next(r for r in step.waiting if r.id == "c")
        step.run(c, c.remaining)
        bad(step)
    return fn


def decode(step, rid):
    return next(r for r in step.running if r.id == rid)


CASES = {
    "unknown_request": (dict(), admit_c_then(lambda s: s.run("ghost", 1)), "ghost"),
    "duplicate": (dict(), lambda s: [("a", 1), ("a", 1)], "a"),
    "tokens": (dict(), admit_c_then(lambda s: s.run("d", 99)), "d"),
    "decode_one_token": (dict(), lambda s: s.run(decode(s, "a"), 2), "a"),
    "budget": (dict(budget=8), admit_c_then(lambda s: s.run("d", 5)), "d"),
    "max_num_seqs": (dict(max_seqs=2), lambda s: [("a", 1), ("b", 1), ("c", 6)], "c"),
    "not_in_step": (dict(), admit_c_then(lambda s: s.drop("a")), "a"),
    "policy_raised": (dict(), admit_c_then(lambda s: 1 / 0), None),
}


@pytest.mark.parametrize("rule", list(CASES))
def test_a_broken_rule_is_named_and_undone(rule):
    kw, fn, req = CASES[rule]
    sched, seqs = setup(**kw)
    sched.set_policy(Bad("bad", fn), sched.token_budget, sched.max_num_seqs, None)
    waiting_before = [s.id for s in sched.waiting]
    with pytest.raises(PolicyError) as e:
        sched.schedule()
    err = e.value
    assert (err.rule, err.step, err.req) == (rule, 1, req)
    assert f"rule `{rule}` at step 1" in str(err) and RULES[rule] in str(err) and "'bad'" in str(err)
    assert [s.id for s in sched.waiting] == waiting_before          # c's admission was undone
    check_blocks(sched, seqs)
    finish_under_chunked(sched, seqs)


def finish_under_chunked(sched, seqs):
    sched.set_policy(resolve("chunked"), 16, 8, None)
    for _ in range(100):
        if not sched.has_work():
            break
        advance(sched, sched.schedule())
    assert all(s.is_finished for s in seqs) and sched.bm.num_used == 0


def test_kv_capacity_names_the_admission_that_does_not_fit():
    sched, seqs = setup(blocks=4)              # a and b hold 2 blocks each: nothing free
    sched.set_policy(Bad("greedy", lambda s: [("a", 1), ("b", 1), ("c", 6)]), 16, 8, None)
    with pytest.raises(PolicyError, match="`kv_capacity` at step 1, request c") as e:
        sched.schedule()
    assert "needs 2 more blocks, 0 are free" in str(e.value)
    check_blocks(sched, seqs)
    sched.set_policy(resolve("chunked"), 16, 8, None)
    for s in seqs[:2]:
        sched.remove(s)                         # room for the prompts: they finish
        s.status = Status.FINISHED
    finish_under_chunked(sched, seqs)


def test_a_victim_that_is_not_running_is_refused():
    sched, seqs = setup(blocks=2)              # a and b hold one block each; their next tokens need another
    pick_waiting = lambda step, needy: step.waiting[0]
    sched.set_policy(Bad("bad-victim", lambda s: [(r, 1) for r in s.decodes], pick_waiting), 16, 8, None)
    with pytest.raises(PolicyError) as e:
        sched.schedule()
    assert (e.value.rule, e.value.req) == ("victim", "a") and "chose 'c', which is not running" in str(e.value)
    check_blocks(sched, seqs)
    finish_under_chunked(sched, seqs)


def test_a_view_kept_after_its_step_cannot_act():
    kept = []

    def fn(step):
        if kept:
            kept[0].run("d", 1)
        kept.append(step)
    sched, seqs = setup()
    sched.set_policy(Bad("hoarder", fn), 16, 8, None)
    sched.schedule()
    with pytest.raises(PolicyError, match="stale_view"):
        sched.schedule()
    check_blocks(sched, seqs)
    finish_under_chunked(sched, seqs)


def test_a_step_that_preempted_admits_nobody():
    sched, seqs = setup(blocks=2)
    everyone = lambda s: [(r, 1) for r in s.decodes] + [(r, r.remaining) for r in s.waiting]
    sched.set_policy(Bad("everyone", everyone), 16, 8, None)
    batch = sched.schedule()                   # a's token needs b's block: b is preempted, c and d wait
    assert [(s.id, n) for s, n in batch.items] == [("a", 1)] and [s.id for s in batch.preempted] == ["b"]
    assert [s.id for s in sched.waiting] == ["b", "c", "d"]
    check_blocks(sched, seqs)
    finish_under_chunked(sched, seqs)


def test_the_engine_survives_a_broken_policy(tmp_path):
    from engine import EngineConfig, LLMEngine
    from tests.helpers import save_tiny_model
    engine = LLMEngine(EngineConfig(model=str(save_tiny_model("llama", tmp_path / "m")), dtype="float32",
                                    num_kv_blocks=64, max_num_batched_tokens=32))
    rids = [engine.add_request(prompt_token_ids=list(range(10 + i, 30 + i)),
                               params=SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(3)]
    engine.step()
    engine.set_policy(Bad("bad", lambda s: [(s.running[0], 5)]))
    with pytest.raises(PolicyError, match="decode_one_token|tokens"):
        engine.step()
    assert engine.settings()["policy"] == "bad"
    engine.set_policy("chunked")
    while engine.has_unfinished():
        engine.step()
    assert all(engine.get_request(r).num_output_tokens == 4 for r in rids)
    assert engine.block_manager.num_used == 0


class Chaos(Policy):
    """Random actions, most of them legal, some not: the checker must refuse the bad ones cleanly."""
    name = "chaos"

    def __init__(self, rng):
        self.rng = rng

    def schedule(self, step):
        rng = self.rng
        for _ in range(rng.randint(0, 6)):
            pool = step.running + step.waiting
            if not pool or rng.random() < 0.03:
                step.run(rng.choice(["ghost", "r0"]), 1)
            r = rng.choice(pool)
            if rng.random() < 0.05 and step.items:
                step.drop(rng.choice(step.items)[0])
                continue
            n = r.remaining if rng.random() < 0.5 else rng.randint(0, r.remaining + 1)
            if rng.random() < 0.8:       # mostly within the budget and the cache, as a careful policy would be
                n = max(1, min(n, step.budget_left)) if step.budget_left > 0 else 0
                if step.blocks_needed(r, r.computed + r.cached + n) > step.free_blocks and not step.is_running(r):
                    continue
            if n > 0 or rng.random() < 0.1:
                step.run(r, n)

    def victim(self, step, needy):
        return self.rng.choice(step.running + step.waiting[:1])


def test_random_policies_are_refused_cleanly_and_nothing_leaks():
    import random
    rules = set()
    for seed in range(300):
        rng = random.Random(seed)
        bs = rng.choice([1, 2, 4])
        sched = Scheduler(BlockManager(rng.randint(6, 24), bs), resolve("chunked"), rng.choice([2, 4, 8, 16]),
                          rng.choice([1, 2, 4]))
        seqs = []
        for i in range(rng.randint(2, 6)):
            s = Sequence(f"r{i}", f"r{i}", [rng.randrange(4) for _ in range(rng.randint(1, 3 * bs + 2))],
                         SamplingParams(max_tokens=rng.randint(1, 4)), 0.0)
            seqs.append(s)
            sched.add(s)
        sched.set_policy(Chaos(rng), sched.token_budget, sched.max_num_seqs, None)
        for _ in range(60):
            if not sched.has_work():
                break
            try:
                batch = sched.schedule()
            except PolicyError as e:
                rules.add(e.rule)
                assert e.rule in RULES and str(e.step) in str(e)
                check_blocks(sched, seqs)
                continue
            assert batch.num_tokens <= sched.token_budget or len(batch.items) == 1
            assert len(batch.items) <= sched.max_num_seqs
            for s, n in batch.items:
                assert len(s.block_table) * bs >= s.num_computed_tokens + n
            check_blocks(sched, seqs)
            advance(sched, batch)
        sched.set_policy(resolve("chunked"), 16, 8, None)
        for _ in range(400):
            if not sched.has_work():
                break
            advance(sched, sched.schedule())
        assert all(s.is_finished for s in seqs) and sched.bm.num_used == 0, f"case {seed}"
    assert {"unknown_request", "tokens", "budget", "victim", "kv_capacity", "duplicate"} <= rules, rules
