"""The engine boundary (engine/protocol.py): what step() returns for each request, the request book both
engines share (engine/outputs/requests.py), and the switch between the single engine and the pair (engine/engines.py).
A tiny random model: the point is the bookkeeping, not the words."""
import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import ShuttingDown
from engine.outputs.requests import RequestBook, StepCounter
from engine.protocol import Engine, RequestOutput
from engine.scheduling.sequence import Status
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def tiny_engine(folder, steps: StepCounter | None = None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=4,
                                  max_num_batched_tokens=24, max_num_seqs=4, **kw), steps=steps)


def test_every_engine_satisfies_the_protocol(tiny):
    from engine.disagg.router import DisaggregatedEngine
    from engine.engines import EngineSwitch
    assert isinstance(tiny_engine(tiny), Engine)
    assert isinstance(EngineSwitch(EngineConfig(model=str(tiny), dtype="float32", num_kv_blocks=64)), Engine)
    members = [m for m in vars(Engine) if not m.startswith("_")] + list(Engine.__annotations__)
    pair_attrs = set(dir(DisaggregatedEngine)) | {"model_name", "max_model_len", "eos_token_ids"}   # set in __init__
    assert [m for m in members if m not in pair_attrs] == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_add_up_to_each_reply(tiny, seed):
    """Random arrivals, stop strings, logprobs and aborts between steps: a request's outputs, joined, are its
    whole reply (text, tokens, logprobs), the last one alone says how it ended, and nothing is said twice."""
    eng, rng = tiny_engine(tiny, seed=seed), random.Random(seed)
    got: dict[str, list[RequestOutput]] = {}
    added = 0

    def take(outputs):
        for o in outputs:
            assert not got.get(o.request_id) or not got[o.request_id][-1].finished, "output after the end"
            got.setdefault(o.request_id, []).append(o)
    while added < 14 or eng.has_unfinished():
        if added < 14 and rng.random() < 0.4:
            params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, temperature=rng.choice([0, 1]),
                                    logprobs=rng.choice([None, 0, 2]), stop=rng.choice([None, ["e"], [" a"]]))
            eng.add_request(prompt_token_ids=[rng.randrange(1, 49152) for _ in range(rng.randint(1, 30))],
                            params=params)
            added += 1
        if eng.requests and rng.random() < 0.1:
            assert eng.abort(rng.choice(list(eng.requests)), "test")
            take(eng.take_outputs())                     # an abort between steps reports at once
        out = eng.step()
        if out is not None:
            assert out.record["type"] == "step"
            take(out.outputs)
    take(eng.take_outputs())
    assert eng.take_outputs() == [] and len(got) == added
    for rid, outs in got.items():
        seq = eng.get_request(rid)
        assert "".join(o.text for o in outs) == seq.output_text
        assert [t for o in outs for t in o.token_ids] == seq.output_token_ids
        assert [o.num_output_tokens for o in outs] == sorted(o.num_output_tokens for o in outs)
        assert outs[-1].num_output_tokens == seq.num_output_tokens
        assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
        assert outs[-1].finish_reason == seq.finish_reason
        assert outs[-1].error == ("test" if seq.finish_reason == "abort" else None)
        assert all(o.text or o.finished for o in outs), "an output with nothing new"
        if seq.params.logprobs is None:
            assert all(o.logprobs is None for o in outs)
        else:
            lps = [lp for o in outs for lp in o.logprobs]
            assert len(lps) == seq.num_output_tokens
            assert [lp.token for lp in lps] == [eng.tokenizer.decode([t]) for t in seq.output_token_ids]
            assert all(len(lp.top) == seq.params.logprobs for lp in lps)


def test_request_book_checks_counts_and_forgets():
    book = RequestBook(decode_token=str, id_prefix="x", max_done=2)
    with pytest.raises(TypeError, match="SamplingParams"):
        book.admit([1], {"max_tokens": 3}, None, None, 1.0)
    a = book.admit([1, 2], None, "Alice", None, 1.0)
    assert (a.id, a.label, book.counters["prompt_tokens"]) == ("x0", "Alice", 2)
    with pytest.raises(ValueError, match="already in use"):
        book.admit([1], None, None, "x0", 1.0)
    b, c = book.admit([3], None, None, None, 1.0), book.admit([4], None, None, None, 1.0)
    assert book.take_outputs() == []                  # nothing said yet: no output
    a.output_token_ids.append(7)                      # a token that added no text rides with the next output
    assert book.take_outputs() == []
    a.output_token_ids.append(8)
    a.output_text = "hi"
    assert book.take_outputs() == [RequestOutput("x0", "hi", [7, 8], 2)]
    book.end(a, Status.FINISHED, "length", None, 1.0)
    book.end(b, Status.ABORTED, "abort", "gone", 1.0)
    book.end(c, Status.ABORTED, "error", "boom", 1.0)
    assert [book.counters[k] for k in ("requests_finished", "requests_aborted", "requests_failed")] == [1, 1, 1]
    assert list(book.done) == ["x1", "x2"] and not book.live   # the oldest ended one is forgotten
    with pytest.raises(KeyError):
        book.get("x0")
    ends = book.take_outputs()                        # x0 was forgotten before anyone asked: no output
    assert [(o.request_id, o.finish_reason, o.error) for o in ends] == \
        [("x1", "abort", "gone"), ("x2", "error", "boom")]


def test_a_replaced_clock_times_every_request(tiny):
    """The what-if replay times its engine with a stopwatch put in place of engine.clock: arrivals,
    events and ends must all read it."""
    eng, now = tiny_engine(tiny), [100.0]
    eng.clock = lambda: now[0]
    events = []
    eng.subscribe(events.append)
    rid = eng.add_request(prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished():
        now[0] += 1.0
        eng.step()
    seq = eng.get_request(rid)
    assert seq.arrival_time == 100.0 and seq.finish_time == 102.0 and seq.token_times == [101.0, 102.0]
    assert [e["t"] for e in events if e["type"] == "request"] == [100.0, 101.0, 102.0]


def test_two_engines_sharing_a_counter_number_their_steps_as_one_stream(tiny):
    steps = StepCounter()
    a, b = tiny_engine(tiny, steps=steps), tiny_engine(tiny, steps=steps)
    records = []
    for e in (a, b):
        e.subscribe(records.append)
        e.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=3, ignore_eos=True))
    while a.has_unfinished() or b.has_unfinished():
        for e in (a, b):
            e.step()
        a.set_policy("continuous" if steps.value % 2 else "chunked")
    numbers = [r["step"] for r in records if r["type"] == "step"]
    assert numbers == list(range(len(numbers))) and a.step_index == b.step_index == len(numbers)
    policies = [r for r in records if r["type"] == "policy"]
    assert all(p["step"] in range(1, len(numbers) + 1) for p in policies)   # the next step to come


def test_the_switch_routes_requests_and_reports_them(tiny, monkeypatch):
    import time

    import engine.disagg.router
    from engine.engines import EngineSwitch
    sw = EngineSwitch(EngineConfig(model=str(tiny), dtype="float32", num_kv_blocks=64))
    rid = sw.add_request(prompt_token_ids=[9, 9, 9], params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert sw.owner == {rid: sw.single} and sw.request_info(rid).prompt_token_ids == [9, 9, 9]
    with pytest.raises(ValueError, match="max_num_seqs"):
        sw.set_policy(max_num_seqs=0)
    outs = []
    while sw.has_unfinished():
        outs += sw.step().outputs
    assert outs[-1].finish_reason == "length" and sw.owner == {}     # ended: no longer routed
    assert sw.stats()["disaggregated"] is None and sw.settings()["policy"] == "chunked"

    def no_pair(*args, **kw):
        raise RuntimeError("no room for two more models")
    monkeypatch.setattr(engine.disagg.router, "DisaggregatedEngine", no_pair)
    sw.set_policy("disaggregated", max_num_batched_tokens=32)
    assert sw.pair_state == "starting" and sw.settings()["max_num_batched_tokens"] == 32
    deadline = time.monotonic() + 30
    while sw.stats()["disaggregated"] == "starting":       # the helper thread's word joins on this thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sw.pair_state == "failed: RuntimeError: no room for two more models"
    rid = sw.add_request(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=1))
    assert sw.owner[rid] is sw.single                       # requests keep going to the single engine


def test_the_service_serves_any_engine_it_is_given(tiny):
    """EngineService(make_engine=...): the whole HTTP path (admission, loop, outputs to streams, one-way
    records to the viewers' ring) on a tiny engine, with an abort on the way."""
    import asyncio

    import httpx

    from app import EngineService, ServerConfig, create_app
    built = []

    def make(call_soon):
        built.append(tiny_engine(tiny))
        return built[-1]
    service = EngineService(EngineConfig(dtype="float32"), ServerConfig(history=1024), make_engine=make)
    service.start(timeout=120)

    async def run():
        transport = httpx.ASGITransport(app=create_app(service, manage_service=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://batchscope.test") as http:
            r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                                         "ignore_eos": True})
            stream = await service.submit(prompt_token_ids=[8, 9], params=SamplingParams(max_tokens=200,
                                                                                        ignore_eos=True))
            first = await stream.__aiter__().__anext__()
            stream.close("client went away")
            rest = [d async for d in stream]
            state = (await http.get("/api/engine")).json()
            last = await service.submit(prompt_token_ids=[8, 9], params=SamplingParams(max_tokens=200,
                                                                                      ignore_eos=True))
            await last.__aiter__().__anext__()
            service.begin_shutdown()
            ended = [d async for d in last][-1]
            with pytest.raises(ShuttingDown):
                await service.submit(prompt_token_ids=[8, 9])
        return r, first, rest, state, last, ended
    try:
        r, first, rest, state, last, ended = asyncio.run(run())
    finally:
        service.stop()
    assert not service.loop.alive                          # the engine is ours again: no other thread uses it
    want = built[0].generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))[0]["text"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert first.finish_reason is None and rest[-1].finish_reason == "abort" and rest[-1].error == "client went away"
    assert state["live_requests"] == 0 and state["kv"]["used"] == 0 and state["disaggregated"] is None
    assert (ended.finish_reason, ended.error) == ("abort", "server shutting down")
    assert isinstance(last.failure, ShuttingDown)        # the type app/api/errors.py maps to 503
    steps = [x for x in service.ring.last_steps(1024)[1] if x["type"] == "step"]
    assert [s["step"] for s in steps] == list(range(len(steps)))


def test_the_pair_stops_once_idle_with_another_setting_in_force(tiny, monkeypatch):
    """Back from `disaggregated`, the pair's workers (two more copies of the model) stop once the pair has
    been idle PAIR_IDLE_S seconds, not while it still serves a request; choosing it again starts a new one."""
    import time

    import engine.disagg.router
    import engine.engines
    from engine.engines import EngineSwitch
    pairs = []

    class Pair:                                 # the DisaggregatedEngine's surface the switch uses
        def __init__(self, config, t0, steps):
            self.busy, self.closed, self.policy = False, False, None
            pairs.append(self)

        def subscribe(self, fn):
            pass

        def set_policy(self, policy=None, **budgets):
            self.policy = policy

        def settings(self):
            return {"policy": "disaggregated"}

        def stats(self):
            return {}

        num_waiting = 0

        def memory(self):
            return {"workers": {}}

        def has_unfinished(self):
            return self.busy

        def take_outputs(self):
            return []

        def close(self):
            self.closed = True
    monkeypatch.setattr(engine.disagg.router, "DisaggregatedEngine", Pair)
    monkeypatch.setattr(engine.engines, "PAIR_IDLE_S", 0.2)
    sw = EngineSwitch(EngineConfig(model=str(tiny), dtype="float32", num_kv_blocks=64))

    def settle(until, seconds=10.0):
        deadline = time.monotonic() + seconds
        while not until():
            assert time.monotonic() < deadline
            sw.stats()                          # runs what the helper thread and the timer handed over
            time.sleep(0.02)
    sw.set_policy("disaggregated")
    settle(lambda: sw.pair_state == "ready")
    first = pairs[0]
    assert sw.engine is first
    first.busy = True                           # a request still in flight on the pair
    sw.set_policy("chunked")
    time.sleep(0.5)
    sw.stats()
    assert sw.pair is first and not first.closed and sw.pair_state == "ready"
    first.busy = False
    settle(lambda: first.closed)
    assert sw.pair is None and sw.pair_state is None and sw.stats()["disaggregated"] is None
    sw.set_policy("disaggregated")              # chosen again: a new pair starts
    settle(lambda: sw.pair_state == "ready")
    assert len(pairs) == 2 and sw.engine is pairs[1] and not pairs[1].closed
    time.sleep(0.4)
    sw.stats()
    assert not pairs[1].closed                  # in force: it stays
    sw.close()
    assert pairs[1].closed


def test_an_admission_crosses_to_the_engine_thread_once_and_its_event_is_published_before_it_returns(tiny):
    """EngineLoop.admit is the whole admission on the engine thread (queue check, add, private arrival log):
    one command per request. The engine only appends its records to a list: nothing it runs calls back
    into the loop or the service, and the loop hands the records on before the caller goes on, so the
    `arrived` event is in the viewers' ring and the arrival log when submit() returns."""
    import asyncio
    import threading

    from app import EngineService, ServerConfig
    from app.serving.front import QueueFull
    service = EngineService(EngineConfig(dtype="float32"), ServerConfig(history=1024, max_waiting=1),
                            make_engine=lambda call_soon: tiny_engine(tiny))
    service.start(timeout=120)
    posted = []
    post = service.loop.post
    service.loop.post = lambda command: (posted.append(command), post(command))[1]
    engine_thread = []

    def seen(obj):                                  # every record reaches the subscribers on the engine thread
        engine_thread.append(threading.current_thread() is service.loop._thread)
    service.loop.subscribe(seen)

    async def run():
        await service.hold("test", 0)               # no step runs: the hold's own request stays waiting
        posted.clear()
        stream = await service.submit(prompt_token_ids=[8, 9, 10], params=SamplingParams(max_tokens=2),
                                      label="Ann", held_by="test")
        crossings = len(posted)
        events = [x for x in service.ring.last_steps(1024)[1] if x.get("event") == "arrived"]
        logged = service.arrival_log.status()["requests"]
        with pytest.raises(QueueFull) as full:      # max_waiting=1: the second is refused on the engine thread
            await service.submit(prompt_token_ids=[8, 9], params=SamplingParams(max_tokens=2))
        service.let_go("test")
        replies = [d async for d in stream]
        return crossings, events, logged, full.value, replies, stream
    try:
        crossings, events, logged, refused, replies, stream = asyncio.run(run())
    finally:
        service.stop()
    assert crossings == 1
    assert [e["req"] for e in events] == [stream.id] and events[0]["label"] == "Ann" and logged == 1
    assert "1 requests are already waiting" in str(refused)
    assert replies[-1].finish_reason == "length" and engine_thread and all(engine_thread)
    assert [getattr(fn, "__self__", None) for fn in service.loop.engine.book.listeners.fns] == [service.loop._records]


def test_a_step_record_names_the_chunk_cap_it_ran_under(tiny):
    """The cap on one prompt's chunk is part of a step's setting (a change of it starts a new stretch of the
    metrics table and a flag on the chart): the record says it, and leaves it out when there is none."""
    eng = tiny_engine(tiny)
    eng.add_request(prompt_token_ids=list(range(1, 30)), params=SamplingParams(max_tokens=3))
    assert "max_prefill_chunk" not in eng.step().record
    eng.set_policy(max_prefill_chunk=4)
    rec = eng.step().record
    assert rec["max_prefill_chunk"] == 4 and all(it["tokens"] <= 4 for it in rec["items"] if it["kind"] == "prefill")
