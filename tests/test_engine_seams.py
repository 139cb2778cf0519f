"""The seams LLMEngine delegates to, tested without a model: records.Listeners (fan-out),
records.read_batch + records.step_record (a step's record), Sequence.stop_reason (when a reply ends)."""
import random
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.outputs.records import (
    KV_MAP_EVERY,
    Listeners,
    PolicyEvent,
    StepRecord,
    read_batch,
    record_fields,
    step_record,
)
from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policies import resolve
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence


def test_listeners_each_get_a_dict_of_their_own_and_a_failing_one_is_removed():
    got_a, got_b, calls = [], [], []

    def a(d):
        d["mine"] = 1               # a reader adding its own field must not reach the others
        got_a.append(d)

    def broken(d):
        calls.append(d)
        raise RuntimeError("a reader's bug")

    listeners = Listeners()
    assert not listeners
    for fn in (a, broken, got_b.append):
        listeners.subscribe(fn)
    event = PolicyEvent(3, 1.5, "chunked", 64, 8, None)
    listeners.emit(event)
    listeners.emit(event)
    assert len(calls) == 1 and len(got_a) == len(got_b) == 2      # removed after its first failure
    assert all("mine" not in d for d in got_b) and got_b[0] == event.to_dict() and got_b[0] is not got_b[1]
    listeners.unsubscribe(broken)                                  # already gone: no error
    listeners.unsubscribe(a)
    listeners.unsubscribe(got_b.append)
    assert not listeners


def test_a_record_becomes_a_dict_once_however_many_listen():
    """emit turns the record into its dict once and returns it (LLMEngine.step hands it on in StepOutputs);
    a listener replacing a top-level field changes neither that dict nor another listener's."""
    calls = []

    class Counted(PolicyEvent):
        def to_dict(self):
            calls.append(1)
            return super().to_dict()

    listeners, seen = Listeners(), []
    listeners.subscribe(lambda d: d.update(policy="mine"))
    listeners.subscribe(seen.append)
    listeners.subscribe(seen.append)
    out = listeners.emit(Counted(3, 1.5, "chunked", 64, 8, None))
    assert len(calls) == 1 and out["policy"] == "chunked" and [d["policy"] for d in seen] == ["chunked"] * 2
    assert seen[0] is not seen[1] and seen[0] is not out
    relayed = dict(out)                            # a dict relayed from the pair's worker: passed on, not copied
    assert Listeners().emit(relayed) is relayed


def test_importing_the_records_and_their_metrics_does_not_import_torch():
    code = ("import sys, engine.outputs.records, engine.scheduling.scheduler, app.readers.metrics; "
            "print(sorted({'torch', 'gradio', 'fastapi'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def reference_stop(seq: Sequence, eos: set[int], max_len: int) -> str | None:
    p, token = seq.params, seq.output_token_ids[-1]
    if token in p.stop_token_ids or (token in eos and not p.ignore_eos):
        return "stop"
    return "length" if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= max_len else None


@settings(max_examples=300)
@given(prompt=st.integers(1, 20), out=st.lists(st.integers(0, 9), min_size=1, max_size=12),
       max_tokens=st.integers(1, 12), stop_ids=st.lists(st.integers(0, 9), max_size=2),
       eos=st.sets(st.integers(0, 9), max_size=2), ignore_eos=st.booleans(), max_len=st.integers(2, 40))
def test_stop_reason_matches_its_definition(prompt, out, max_tokens, stop_ids, eos, ignore_eos, max_len):
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    seq = Sequence("r", "r", [1] * prompt, params, 0.0)
    for i, token in enumerate(out):
        seq.append_token(token, float(i))
    assert seq.stop_reason(eos, max_len) == reference_stop(seq, eos, max_len)


def test_step_records_from_a_model_free_run_say_what_the_scheduler_did():
    """Scheduler + BlockManager driven with made-up tokens; each record built as LLMEngine.step builds it."""
    rng = random.Random(7)
    bm = BlockManager(12, 4)
    bm.log = []
    sched = Scheduler(bm, resolve("chunked"), 6, 3)
    seqs = [Sequence(f"r{i}", f"u{i}", [rng.randrange(50) for _ in range(rng.randint(3, 14))],
                     SamplingParams(max_tokens=rng.randint(2, 6)), 0.0) for i in range(6)]
    for s in seqs:
        sched.add(s)
    clock = iter(range(10 ** 6)).__next__
    step = 0
    while sched.has_work():
        t0 = clock()
        batch = sched.schedule()
        t1 = clock()
        before = read_batch(batch, sched.running)
        ready_left_out = [s.id for s in sched.running if s.is_prefill_done and s not in batch]
        want_items = [(s.id, n) for s, n in batch.items]
        tokens = [rng.randrange(50) for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens]
        finished = [s.id for s, _ in sched.update(batch, tokens, float(step))
                    if s.num_output_tokens >= s.params.max_tokens]
        for rid in finished:
            sched.remove(next(s for s in seqs if s.id == rid))
        rec = step_record(step, sched, batch, before, finished, None, (t0, t1, clock(), clock()), clock, "cpu/float32")
        assert isinstance(rec, StepRecord)
        d = rec.to_dict()
        assert set(d) <= set(record_fields()["step"]) and d["device"] == "cpu/float32"
        assert [(i["req"], i["tokens"]) for i in d["items"]] == want_items
        assert d["num_tokens"] == sum(n for _, n in want_items) <= 6 or d["policy"] != "chunked"
        assert d["stalled"] == ready_left_out == [c["req"] for c in d["stall_causes"]]
        assert d["finished"] == finished and d["running"] == len(sched.running) and d["waiting"] == len(sched.waiting)
        assert d["kv"]["used"] == bm.num_used and ("kv_map" in d) == (step % KV_MAP_EVERY == 0)
        t = d["timing"]
        assert t["schedule"] == t1 - t0 and t["items"] == 1 and t["forward"] == 1 and t["record"] == 1
        assert not bm.log                    # the record took the block changes with it
        step += 1
    assert step > len(seqs) and all(s.num_output_tokens == s.params.max_tokens for s in seqs)
