"""What-if replay: the arrival log (private, bounded), the settings check, the per-user rows, and a live
session replayed through the real server against demos.compare running the same scenario."""
from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.readers import metrics
from app.replay.arrival_log import ArrivalLog, from_saved
from app.replay.scenarios import Arrival, Scenario, _chat
from app.replay.whatif import Stopwatch, WhatIfError, check_settings, to_scenario
from engine import SamplingParams

SECRET = "zebra marmalade quartz"          # a prompt that must never leave the server but to the presenter


# ---- the log, without a model ----
def step(i: int, items: list[tuple[str, str]], t: float | None = None) -> dict:
    t = float(i) if t is None else t
    return {"type": "step", "step": i, "t_start": t, "t_end": t + 0.5, "token_budget": 8, "max_num_seqs": 4,
            "policy": "chunked", "num_tokens": len(items), "stalled": [],
            "items": [{"req": r, "label": r.upper(), "kind": k, "tokens": 1, "completes_prompt": True}
                      for r, k in items]}


def event(kind: str, req: str, t: float) -> dict:
    return {"type": "request", "event": kind, "req": req, "label": req.upper(), "t": t}


def test_log_keeps_arrivals_counts_tokens_and_returns_ended_ones():
    log = ArrivalLog()
    log.observe(step(0, [("x", "decode")]))                  # before any arrival: not kept
    log.observe(event("arrived", "a", 1.0))                 # the engine publishes it before the log hears of it
    log.arrived("a", "A", 1.0, 1, [5, 6, 7], SamplingParams(max_tokens=3))
    log.observe(step(1, [("a", "prefill")]))
    log.arrived("b", "B", 1.6, 2, [8], SamplingParams(max_tokens=9))
    log.observe(step(2, [("a", "decode"), ("b", "prefill")]))
    log.observe(event("finished", "a", 2.5))
    done, records, left_out = log.window()
    assert [(a.req, n) for a, n in done] == [("a", 2)] and left_out == 1
    assert [r.get("step") for r in records if r["type"] == "step"] == [1, 2]
    assert [(r["event"], r["req"]) for r in records if r["type"] == "request"] == [("arrived", "a"), ("finished", "a")]
    assert log.status()["requests"] == 2 and log.status()["ended"] == 1
    log.clear()
    assert log.window() == ([], [], 0) and log.status()["requests"] == 0


def test_log_is_bounded_and_says_it_is_full():
    log = ArrivalLog(max_requests=2, max_steps=3)
    for i in range(4):
        log.arrived(f"r{i}", "U", float(i), i, [1], SamplingParams())
    assert log.status()["requests"] == 2 and log.full
    log = ArrivalLog(max_requests=5, max_steps=3)
    log.arrived("r0", "U", 0.0, 0, [1], SamplingParams())
    for i in range(10):
        log.observe(step(i, [("r0", "decode")]))
    assert log.status()["steps"] == 3 and log.full


def test_a_sampled_request_gets_a_seed_and_a_greedy_one_is_left_alone():
    greedy = SamplingParams()
    assert ArrivalLog.seeded(greedy) is greedy
    seeded = ArrivalLog.seeded(SamplingParams(temperature=0.8))
    assert isinstance(seeded.seed, int)
    assert ArrivalLog.seeded(SamplingParams(temperature=0.8, seed=3)).seed == 3


@pytest.mark.parametrize("settings, words", [
    (None, "list of 1 to"), ([], "list of 1 to"), ([{}], "must be an object"), ([{"policy": "fast"}], "policy must be"),
    ([{"max_num_batched_tokens": 0}], "positive integer"), ([{"max_num_seqs": True}], "positive integer"),
    ([{"temperature": 1}], "unknown key"), ([{"policy": "static"}] * 5, "list of 1 to")])
def test_bad_settings_are_refused_with_the_reason(settings, words):
    with pytest.raises(WhatIfError, match=words):
        check_settings(settings)


def test_an_empty_log_is_refused():
    with pytest.raises(WhatIfError, match="no finished requests"):
        to_scenario([])


def test_to_scenario_keeps_steps_ids_seeds_and_live_lengths():
    log = ArrivalLog()
    log.arrived("a", "Ann", 0.0, 7, [1, 2], SamplingParams(temperature=0.7, seed=11, top_k=5))
    log.arrived("b", "Dan", 0.1, 10, [3], SamplingParams(max_tokens=50))
    for i, items in enumerate([[("a", "prefill")], [("a", "decode"), ("b", "prefill")]]):
        log.observe(step(7 + i, items))
    log.observe(event("aborted", "a", 9.0))
    log.observe(event("finished", "b", 9.0))
    sc = to_scenario(log.window()[0])
    assert [(a.at, a.label, a.prompt_token_ids, a.max_tokens) for a in sc.arrivals] == \
        [(0, "Ann", (1, 2), 2), (3, "Dan", (3,), 1)]
    assert sc.arrivals[0].params().seed == 11 and sc.arrivals[0].params().top_k == 5
    saved = json.loads(json.dumps({"type": "arrival_log", "arrivals": [
        {"req": a.req, "label": a.label, "t": a.t, "step": a.step, "prompt_token_ids": list(a.prompt_token_ids),
         "params": a.params.__dict__, "output_tokens": n} for a, n in log.window()[0]]}))
    assert to_scenario(from_saved(saved)) == sc
    with pytest.raises(ValueError, match="not an arrival log"):
        from_saved({"records": []})


def test_stopwatch_counts_only_while_started():
    clock = Stopwatch()
    clock.start()
    time.sleep(0.02)
    clock.stop()
    stopped = clock()
    time.sleep(0.03)
    assert clock() == stopped and 0.015 < stopped < 0.5


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["decode", "prefill"])), min_size=1, max_size=40))
def test_user_rows_split_the_stream_by_label(items):
    """Rows add up to the whole: every output token in exactly one row, the worst TTFT per label."""
    reqs = {f"r{r}" for r, _ in items}
    stream = [dict(event("arrived", r, 0.0), label="L" + r[-1:] if r != "r3" else "L0") for r in sorted(reqs)]
    for i, (r, kind) in enumerate(items):
        stream.append(step(i, [(f"r{r}", kind)], t=1.0 + i))
    rows = metrics.user_rows(stream)
    assert sum(row["output_tokens"] for row in rows) == sum(len(v) for v in metrics.tokens(stream).values())
    ttft = metrics.ttfts(stream)
    for row in rows:
        mine = [r for r in reqs if stream[0] and metrics.labels(stream)[r] == row["label"]]
        assert row["ttft_s"] == max(ttft[r] for r in mine)


# ---- through the real server ----
SCENARIO = Scenario(
    name="whatif-test", description="three users, the last with a longer prompt",
    arrivals=(Arrival(at=0, label="Ann", max_tokens=10, messages=_chat(f"Count slowly. {SECRET}")),
              Arrival(at=3, label="Bob", max_tokens=5, messages=_chat("Name a colour.")),
              Arrival(at=5, label="Dan", max_tokens=3, messages=_chat("Summarise: " + "the quick fox " * 8))),
    engine={"max_num_batched_tokens": 64, "max_num_seqs": 8})


def shapes(stream: list[dict]) -> list[list[tuple]]:
    return [[(i["label"], i["kind"], i["tokens"]) for i in r["items"]] for r in metrics.steps(stream)]


def play_live(live_server, scenario: Scenario):
    """Send each arrival through /v1/chat/completions just before its step (slow motion makes room)."""
    service, base, threads, replies = live_server.service, None, [], {}

    def send(a: Arrival):
        replies[a.label] = live_server.chat(a.messages[0]["content"], user=a.label, max_tokens=a.max_tokens,
                                            ignore_eos=True).json()
    for a in scenario.arrivals:
        while base is not None and service.engine.step_index < base + a.at:
            time.sleep(0.005)
        base = service.engine.step_index if base is None else base
        threads.append(threading.Thread(target=send, args=(a,)))
        threads[-1].start()
        while service.arrival_log.status()["requests"] < len(threads):
            time.sleep(0.005)
    for t in threads:
        t.join(120)
    return replies


def test_live_session_replays_like_demos_compare_and_stays_private(real_server, monkeypatch):
    """On the real default model, as demos.compare runs it: the replay computes what compare computes,
    step for step, and reports app/readers/metrics.py over its own records, timed by its own clock."""
    live_server = real_server
    from websockets.sync.client import connect

    from demos.compare.scenario import run_policy
    http, key = live_server.http, {"X-Presenter-Key": live_server.key}
    assert http.delete("/api/whatif/log").status_code == 403            # the audience cannot touch the log
    assert http.delete("/api/whatif/log", headers=key).json()["requests"] == 0
    empty = http.post("/api/whatif", json={"settings": [{"policy": "static"}]}, headers=key)
    assert empty.status_code == 400 and "no finished requests" in empty.json()["error"]["message"]

    before = live_server.engine()
    live_server.set_engine(policy="continuous", max_num_batched_tokens=64, max_num_seqs=8, step_delay=0.3)
    seen: list[str] = []
    with connect(live_server.ws, proxy=None, compression=None, open_timeout=30) as ws:
        stop = threading.Event()

        def read():
            while not stop.is_set():
                try:
                    seen.append(ws.recv(timeout=0.2))
                except TimeoutError:
                    pass
        reader = threading.Thread(target=read)
        reader.start()
        try:
            replies = play_live(live_server, SCENARIO)
        finally:
            live_server.set_engine(policy=before["policy"], max_num_batched_tokens=before["max_num_batched_tokens"],
                                   max_num_seqs=before["max_num_seqs"], step_delay=0.0)
            time.sleep(0.5)
            stop.set()
            reader.join()
    assert all(replies[a.label]["usage"]["completion_tokens"] == a.max_tokens for a in SCENARIO.arrivals)
    logged = [(a.step, a.label) for a, _ in live_server.service.arrival_log.window()[0]]
    assert [s - logged[0][0] for s, _ in logged] == [a.at for a in SCENARIO.arrivals], "arrivals missed their step"

    # what a viewer can see carries no prompt: not the stream, not the traces, not the what-if routes
    ids = live_server.service.arrival_log.window()[0][0][0].prompt_token_ids
    public = seen + [http.get("/api/trace", params={"last": 1024, "format": f}).text for f in ("json", "chrome")]
    public.append(http.get("/api/engine").text)
    for text in public:
        assert SECRET not in text and "prompt_token_ids" not in text and json.dumps(list(ids[:12]))[1:-1] not in text
    for path in ("/api/whatif", "/api/whatif/log", "/api/whatif/result"):
        assert http.get(path).status_code == 403

    monkeypatch.setattr("app.api.whatif_api.TIME_LIMIT_S", 1e-3)
    too_long = http.post("/api/whatif", json={"settings": [{"policy": "chunked"}]}, headers=key)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "too_long"
    monkeypatch.undo()

    setting = {"policy": "chunked", "max_num_batched_tokens": 16}
    res = http.post("/api/whatif", json={"settings": [setting]}, headers=key, timeout=900)
    assert res.status_code == 200, res.text
    body = res.json()
    assert [u["label"] for u in body["actual"]["users"]] == ["Ann", "Bob", "Dan"]
    assert [u["output_tokens"] for u in body["whatif"][0]["users"]] == [10, 5, 3]
    assert body["actual"]["metrics"]["num_steps"] >= 1 and body["whatif"][0]["settings"] == setting
    runs = http.get("/api/whatif/result", headers=key).json()["runs"]
    replayed = runs[1]["records"]

    ref = run_policy(SCENARIO, "chunked", {"max_num_batched_tokens": 16, "kv_cache_gb": 0.25}, progress=False)
    assert shapes(replayed) == shapes(ref.stream)
    assert body["whatif"][0]["metrics"]["num_steps"] == metrics.summarize(ref.stream)["num_steps"]
    # timings: what the replay reports is app/readers/metrics.py over its own records, and its clock
    # counts only its own steps, none of the live engine's (their seconds drift with the machine's load,
    # so they are not compared with demos.compare's: the steps above are, one by one)
    mine = body["whatif"][0]["metrics"]
    assert mine == metrics.summarize(replayed)
    busy = sum(r["t_end"] - r["t_start"] for r in metrics.steps(replayed))
    assert busy <= mine["duration_s"] < busy * 1.1 + 0.2

    html = http.get("/api/whatif/result", params={"format": "html"}, headers=key)
    assert html.status_code == 200 and "what-if 1: chunked, budget 16" in html.text and SECRET not in html.text
    chrome = http.get("/api/whatif/result", params={"format": "chrome"}, headers=key).json()
    assert {e["pid"] for e in chrome["traceEvents"]} == {1, 2}
    saved = http.get("/api/whatif/log", headers=key).json()
    assert to_scenario(from_saved(saved)).arrivals[2].label == "Dan"


def test_compare_reads_a_saved_log_with_the_live_budgets(tmp_path):
    from demos.compare.scenario import saved_session
    doc = {"type": "arrival_log", "version": 1, "model": "m", "device": "cpu", "dtype": "float32",
           "settings": {"policy": "continuous", "max_num_batched_tokens": 64, "max_num_seqs": 8},
           "arrivals": [{"req": "r1", "label": "Dan", "t": 0.5, "step": 4, "prompt_token_ids": [9, 8],
                         "params": SamplingParams(max_tokens=20).__dict__, "output_tokens": 6}],
           "records": [event("arrived", "r1", 0.5), step(4, [("r1", "prefill")])]}
    (tmp_path / "saved.json").write_text(json.dumps(doc))
    scenario, actual = saved_session(str(tmp_path / "saved.json"))
    assert scenario.engine == {"max_num_batched_tokens": 64, "max_num_seqs": 8}
    assert [(a.at, a.label, a.max_tokens, a.prompt_token_ids) for a in scenario.arrivals] == [(0, "Dan", 6, (9, 8))]
    assert actual.meta["policy"] == "continuous" and len(actual.stream) == 2
    (tmp_path / "viewer.json").write_text(json.dumps({"records": []}))
    with pytest.raises(SystemExit, match="not an arrival log"):
        saved_session(str(tmp_path / "viewer.json"))


def test_the_speculative_lessons_traffic_replays_without_and_with_speculation(tiny_model):
    """The speculative lesson's arrivals, served live with speculation, replayed by the what-if job: a
    setting that does not ask for speculation runs without it (even where the live engine was started with
    it), one that asks runs with it; both produce every token (1 + accepted per verifying decode counted)."""
    from app.replay.scenarios import LESSON_SPECULATION, get_scenario
    from app.replay.whatif import WhatIfJob
    from demos.compare.runner import run_scenario
    from engine import EngineConfig, LLMEngine
    config = EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.1,
                          speculative_config=LESSON_SPECULATION)
    scenario = get_scenario("speculative-room", reply_tokens=64, room=3, room_at=4, room_tokens=40)
    actual = run_scenario(LLMEngine(config), scenario).stream
    assert metrics.summarize(actual)["draft_tokens"] > 0
    with pytest.raises(WhatIfError, match="'lookup'"):
        check_settings([{"speculative_config": {**LESSON_SPECULATION, "lookup": 2}}])
    settings = check_settings([{"policy": "chunked"}, {"policy": "chunked", "speculative_config": LESSON_SPECULATION}])
    job = WhatIfJob(scenario, actual, settings, config, {"settings": {"policy": "chunked"}})
    while job.slice():
        pass
    assert job.error is None and job.progress["fraction"] == 1.0
    off, on = (m["metrics"] for m in job.result["whatif"])
    assert off["draft_tokens"] == 0 and off["acceptance_rate"] is None and on["draft_tokens"] > 0
    assert off["output_tokens"] == on["output_tokens"] == scenario.total_output_tokens
    assert "speculation k=3" in list(job.report_runs())[2]


def _replay(scenario, actual, settings, config):
    from app.replay.whatif import WhatIfJob
    job = WhatIfJob(scenario, actual, check_settings(settings), config, {"settings": {"policy": "chunked"}})
    while job.slice():
        pass
    assert job.error is None and job.progress["fraction"] == 1.0
    return job, [r.stream for r in job.runs]


def prefill_tokens(stream: list[dict]) -> int:
    return sum(i["tokens"] for r in metrics.steps(stream) for i in r["items"] if i["kind"] == "prefill")


def test_cache_settings_are_checked_and_named():
    from app.replay.whatif import describe
    for bad, words in (({"enable_prefix_caching": "no"}, "true or false"), ({"max_kv_blocks": 0}, "positive"),
                       ({"max_kv_blocks": True}, "positive")):
        with pytest.raises(WhatIfError, match=words):
            check_settings([bad])
    assert check_settings([{"max_kv_blocks": None, "enable_prefix_caching": False}])
    assert describe({"policy": "chunked", "enable_prefix_caching": False, "max_kv_blocks": 24}) == \
        "chunked, no prefix caching, KV cap 24 blocks"


def test_the_prefix_lessons_traffic_replays_with_and_without_prefix_caching(tiny_model):
    """Lesson 6's shared system prompt, served live with prefix caching, replayed with it off and on: off,
    no prompt token is cached and every cached one is computed instead; on, the replay finds what live found."""
    from app.replay.scenarios import get_scenario
    from demos.compare.runner import run_scenario
    from engine import EngineConfig, LLMEngine
    config = EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.1)
    scenario = get_scenario("shared-system-prompt", users=4, every=4, reply_tokens=8)
    actual = run_scenario(LLMEngine(config), scenario).stream
    live = metrics.summarize(actual)
    assert live["cached_prompt_tokens"] >= 3 * 16 * 16          # three later users find the ~350-token prompt
    job, (off, on) = _replay(scenario, actual, [{"policy": "chunked", "enable_prefix_caching": False},
                                                {"policy": "chunked"}], config)
    m_off, m_on = (w["metrics"] for w in job.result["whatif"])
    assert m_off["cached_prompt_tokens"] == 0 and m_on["cached_prompt_tokens"] == live["cached_prompt_tokens"]
    assert all(r.get("prefix_caching") is False for r in metrics.steps(off))
    assert prefill_tokens(off) == prefill_tokens(on) + m_on["cached_prompt_tokens"]
    assert m_off["output_tokens"] == m_on["output_tokens"] == scenario.total_output_tokens
    assert "no prefix caching" in list(job.report_runs())[1]


def test_the_memory_lessons_traffic_replays_with_and_without_the_kv_cap(tiny_model):
    """Lesson 7's long replies, replayed under its KV cap and without one: under the cap requests are
    preempted and recomputed (more prefill, every step within the cap), without it none is; both give
    every token."""
    from app.replay.scenarios import MEMORY_PRESSURE_BLOCKS, get_scenario
    from demos.compare.runner import run_scenario
    from engine import EngineConfig, LLMEngine
    config = EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.1, enable_prefix_caching=False)
    scenario = get_scenario("memory-pressure")
    actual = run_scenario(LLMEngine(config), scenario).stream
    capped = {"policy": "chunked", "max_kv_blocks": MEMORY_PRESSURE_BLOCKS}
    job, (cap, whole) = _replay(scenario, actual, [capped, {"policy": "chunked"}], config)
    m_cap, m_whole = (w["metrics"] for w in job.result["whatif"])
    assert m_cap["num_preemptions"] > 0 and m_whole["num_preemptions"] == 0
    assert all(r["kv"].get("limit") == MEMORY_PRESSURE_BLOCKS and r["kv"]["used"] <= MEMORY_PRESSURE_BLOCKS
               for r in metrics.steps(cap))
    assert all(r["kv"].get("limit") is None for r in metrics.steps(whole))
    assert max(r["kv"]["used"] for r in metrics.steps(whole)) > MEMORY_PRESSURE_BLOCKS
    assert prefill_tokens(cap) > prefill_tokens(whole)                # the recomputes are read again
    assert m_cap["output_tokens"] == m_whole["output_tokens"] == scenario.total_output_tokens
    assert "KV cap 24 blocks" in list(job.report_runs())[1]
