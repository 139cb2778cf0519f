"""Scenarios, the runner, traces, and smoke runs of compare and bench on a tiny random model."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from app.readers import metrics
from app.replay.scenarios import SCENARIOS, Arrival, Scenario, get_scenario, load_text
from demos.compare import trace
from demos.compare.runner import run_scenario
from engine import EngineConfig, LLMEngine
from engine.weights.loader import resolve_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and a shared CPU makes two threads wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in resolve_model(None).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return str(folder)


def tiny_engine(model, **kw):
    return LLMEngine(EngineConfig(model=model, dtype="float32", **kw))


# ---- scenarios ----
def test_every_scenario_is_fixed_data():
    for name in SCENARIOS:
        a, b = get_scenario(name), get_scenario(name)
        assert a == b and a.name == name and a.arrivals
        assert [x.at for x in a.arrivals] == sorted(x.at for x in a.arrivals)
        assert all(x.max_tokens >= 1 for x in a.arrivals)


def test_long_prompt_interrupts_shape():
    sc = get_scenario("long-prompt-interrupts")
    users = [a for a in sc.arrivals if a.label != "Doc"]
    doc = next(a for a in sc.arrivals if a.label == "Doc")
    assert len(users) == 3 and sc.focus == "Doc" and sc.clock == "step"
    assert all(a.at < doc.at for a in users)
    assert "Carrick Point" in doc.messages[-1]["content"]


def test_long_document_is_about_1500_tokens():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    assert 1300 <= len(tok.encode(load_text("lighthouse_report"))) <= 1700


def test_bursty_is_seeded_poisson():
    a, b, c = get_scenario("bursty", seed=3), get_scenario("bursty", seed=3), get_scenario("bursty", seed=4)
    assert a.arrivals == b.arrivals and a.arrivals != c.arrivals and a.clock == "wall"
    big = get_scenario("bursty", rate=5.0, n=3000)
    gaps = [y.at - x.at for x, y in zip(big.arrivals, big.arrivals[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 5.0, rel=0.08)     # mean gap of a Poisson process
    assert sum(g < 0.2 for g in gaps) / len(gaps) == pytest.approx(1 - 2.718281828 ** -1, abs=0.04)
    with pytest.raises(ValueError):
        get_scenario("bursty", rate=0)


def test_scenario_validation():
    with pytest.raises(ValueError):
        Arrival(at=0, label="x", max_tokens=4)                       # neither prompt nor messages
    with pytest.raises(ValueError):
        Scenario("s", "", (Arrival(5, "a", 1, prompt="p"), Arrival(1, "b", 1, prompt="p")))   # unsorted
    with pytest.raises(ValueError):
        Scenario("s", "", (Arrival(0, "a", 1, prompt="p"),), focus="nobody")
    with pytest.raises(KeyError):
        get_scenario("no-such-scenario")


# ---- runner ----
def _index(stream, pred):
    return next(i for i, o in enumerate(stream) if pred(o))


def test_step_clock_arrivals_join_before_their_step(tiny_model):
    sc = get_scenario("long-prompt-interrupts", reply_tokens=12, doc_at=6, doc_tokens=3)
    run = run_scenario(tiny_engine(tiny_model), sc)
    s = run.stream
    doc = run.request_of("Doc")
    first = metrics.steps(s)[0]["step"]
    arrived = _index(s, lambda o: o.get("event") == "arrived" and o["req"] == doc)
    assert _index(s, lambda o: o.get("type") == "step" and o["step"] == first + 5) < arrived
    assert arrived < _index(s, lambda o: o.get("type") == "step" and o["step"] == first + 6)
    times = metrics.token_times(s)
    assert [len(times[r]) for r in run.request_ids] == [a.max_tokens for a in sc.arrivals]
    assert set(metrics.decoding_at(s, metrics.arrivals(s)[doc])) <= set(run.request_ids[:3])


def test_idle_engine_skips_ahead_to_the_next_step_arrival(tiny_model):
    sc = Scenario("gap", "", (Arrival(0, "a", 3, prompt="one"), Arrival(10_000, "b", 3, prompt="two")))
    run = run_scenario(tiny_engine(tiny_model), sc)
    assert len(metrics.steps(run.stream)) < 20
    t = metrics.token_times(run.stream)
    assert t[run.request_ids[0]][-1] <= metrics.arrivals(run.stream)[run.request_ids[1]]


def test_wall_clock_arrivals_wait_for_their_time(tiny_model):
    sc = Scenario("wall", "", (Arrival(0.0, "a", 2, prompt="one"), Arrival(0.3, "b", 2, prompt="two")), clock="wall")
    run = run_scenario(tiny_engine(tiny_model), sc)
    arr = metrics.arrivals(run.stream)
    a, b = arr[run.request_ids[0]], arr[run.request_ids[1]]
    # b is due 0.3 s after the scenario's clock starts. Arrival times are on the engine's clock, which starts
    # when the engine is built, before the scenario's: b's time is at least 0.3 s on it. a is due at once, but
    # on a loaded machine its adding may come tens of milliseconds after the scenario's clock started, so the
    # gap between them is only known to be clearly more than nothing (without the wall clock it would be ~0)
    assert b >= 0.3
    assert 0.15 < b - a < 0.3 + 5.0   # and not long after
    assert run.wall_s >= 0.3


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st


@given(st.lists(st.integers(0, 30), min_size=1, max_size=8), st.lists(st.integers(1, 4), min_size=1, max_size=60),
       st.sampled_from(["step", "wall"]))
def test_one_replay_hands_out_every_arrival_once_in_order_when_due(ats, ticks, clock):
    """app/replay/play.py's Replay, used by demos/compare/runner.py and the page's lessons: whatever the clock
    does, each arrival comes exactly once, in scenario order, never before its time; idle skips ahead."""
    from app.replay.play import Replay
    sc = Scenario("r", "", tuple(Arrival(a, f"u{i}", 1, prompt="x") for i, a in enumerate(sorted(ats))), clock=clock)
    r, now, got = Replay(sc), 0, []
    for dt in ticks:
        for i, a in r.due(now, float(now)):
            assert a.at <= now
            got.append(i)
        if r.done:
            break
        now = r.skip_idle(now) if dt == 4 and clock == "step" else now + dt   # 4: the engine went idle
        assert r.skip_idle(now) >= now
    else:
        got += [i for i, _ in r.due(10 ** 6, 1e6)]
    assert got == list(range(len(ats))) and r.done


# ---- traces ----
def test_trace_round_trip_and_chrome_events(tiny_model, tmp_path):
    sc = get_scenario("static-vs-continuous", reply_tokens=(2, 5, 3), max_num_seqs=2)
    engine = tiny_engine(tiny_model, policy="continuous", max_num_seqs=2)
    run = run_scenario(engine, sc)
    trace.save(tmp_path / "t.json", run.stream, meta=run.meta)
    objs = trace.load(tmp_path / "t.json")
    assert objs[0]["type"] == "trace" and trace.header(objs)["scenario"] == sc.name
    assert objs[1:] == json.loads(json.dumps(run.stream))
    assert metrics.summarize(objs) == metrics.summarize(run.stream)
    chrome = trace.to_chrome(objs)
    ev = chrome["traceEvents"]
    recs = metrics.steps(run.stream)
    spans = [e for e in ev if e["ph"] == "X"]
    assert len(spans) == len(recs) + sum(len(r["items"]) for r in recs)
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"steps", f"U1 ({run.request_ids[0]})"} <= names
    first = next(e for e in spans if e["cat"] == "step")
    assert first["ts"] == pytest.approx(recs[0]["t_start"] * 1e6)
    trace.main([str(tmp_path / "t.json"), "--chrome", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["traceEvents"]
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError):
        trace.load(tmp_path / "bad.json")


# ---- compare and bench, end to end on the tiny model ----
def test_compare_smoke(tiny_model, tmp_path):
    from demos.compare import scenario as compare
    out, js = tmp_path / "r.html", tmp_path / "m.json"
    compare.main(["--scenario", "long-prompt-interrupts", "--policies", "static,continuous,chunked",
                  "--model", tiny_model, "--dtype", "float32", "--out", str(out), "--json", str(js),
                  "--traces", str(tmp_path / "traces"), "--param", "reply_tokens=12", "--param", "doc_at=6",
                  "--param", "doc_tokens=4", "--quiet", "--md", str(tmp_path / "m.md")])
    doc = json.loads(js.read_text())
    keys = ["ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "tbt_max_s", "output_tokens_per_s",
            "num_steps", "num_preemptions"]
    for policy in ("static", "continuous", "chunked"):
        s = doc["policies"][policy]
        assert all(s[k] is not None for k in keys)
        assert s["output_tokens"] == 3 * 12 + 4 and s["tbt_p99_s"] <= s["tbt_max_s"]
    # the long prompt is one step under continuous, chunks that carry every decode under chunked
    cont, chunk = doc["policies"]["continuous"], doc["policies"]["chunked"]
    assert cont["focus"]["stall_count"] >= len(cont["focus"]["victims"]) >= 2
    assert chunk["focus"]["stall_count"] == 0 and chunk["focus"]["victims"]
    assert cont["budget_fill_max"] > 5 and chunk["budget_fill_max"] <= 1.0
    assert doc["ratios"]["victims_tbt_max_s_continuous_over_chunked"] is not None
    page = out.read_text()
    assert "Plotly.newPlot" in page and "<script src=\"http" not in page   # plotly embedded: opens offline
    assert page.count("class=\"plotly-graph-div\"") == 3 + 4
    assert len(list((tmp_path / "traces").glob("*.json"))) == 6
    md = (tmp_path / "m.md").read_text()
    assert "| output tokens/s |" in md
    assert f"| steps | {doc['policies']['static']['num_steps']} | {cont['num_steps']} | {chunk['num_steps']} |" in md
    from demos.compare import figure
    figure.main(["--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "f.svg")])
    svg = (tmp_path / "f.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == len(cont["focus"]["victims"]) + len(
        chunk["focus"]["victims"]) and "continuous: time between tokens" in svg


def test_the_printed_tables_go_to_the_stdout_of_the_moment(monkeypatch):
    """The summary tables print to sys.stdout as it is when they print, not as it was when their module was
    imported (pytest and the lecture's runner swap it; a default bound at import wrote to a closed file)."""
    import io

    from demos.bench import against_hf
    from demos.compare import scenario
    keys = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "tbt_max_s",
            "num_steps", "num_preemptions")
    now = io.StringIO()
    monkeypatch.setattr("sys.stdout", now)
    scenario.print_table({"chunked": dict.fromkeys(keys)})
    against_hf.print_summary({"systems": {"batchscope-chunked": dict.fromkeys(keys)}})
    assert "chunked" in now.getvalue() and "batchscope-chunked" in now.getvalue()


def test_bench_smoke(tiny_model, tmp_path):
    from demos.bench import against_hf as bench
    js = tmp_path / "b.json"
    bench.main(["--model", tiny_model, "--requests", "5", "--prompt-range", "8,40", "--output-range", "2,9",
                "--batch", "2", "--budget", "64", "--decode-batches", "1,3", "--decode-context", "40",
                "--decode-repeats", "3", "--json", str(js), "--quiet", "--md", str(tmp_path / "b.md")])
    doc = json.loads(js.read_text())
    want = doc["workload"]["output_tokens"]
    assert set(doc["systems"]) == {"batchscope-static", "batchscope-continuous", "batchscope-chunked",
                                   "hf-static", "hf-cb"}
    for name, s in doc["systems"].items():
        assert "error" not in s, s
        assert s["output_tokens"] == want and s["output_tokens_per_s"] > 0 and s["ttft_p50_s"] > 0
    assert doc["systems"]["hf-static"]["generated_tokens_incl_padding_waste"] >= want
    assert doc["ratios"]["batchscope-chunked"]["output_tokens_per_s_vs_hf-static"] > 0
    for r in doc["record"].values():
        assert 0 < r["fraction"] < 1
    d = doc["decode"]
    assert d["copy_bandwidth_gb_s"] > 0 and set(d["batches"]) == {"1", "3"}
    md = (tmp_path / "b.md").read_text()
    assert all(f"| {name} |" in md for name in doc["systems"]) and "| 3 |" in md
    import torch
    dtypes = {"float32", "int8"} if "fbgemm" in torch.backends.quantized.supported_engines else {"float32"}
    for b in d["batches"].values():
        assert b["hf_forward_ms"] > 0 and set(b["ours"]) == dtypes
        for o in b["ours"].values():
            assert o["step_ms"] > 0 and o["weight_plus_kv_floor_ms"] > o["weight_floor_ms"] > 0
    if "int8" in dtypes:     # the int8 step reads fewer bytes, so its floor is lower
        one = d["batches"]["1"]["ours"]
        assert one["int8"]["weight_floor_ms"] < one["float32"]["weight_floor_ms"] and d["int8_speedup_batch1"] > 0


def test_one_chrome_converter_every_event_on_a_track():
    """demos.compare.trace and the server's /api/trace?format=chrome use app/readers/trace.py; every event names
    its track."""
    from app.readers.trace import chrome_trace
    from tests.factories import stall_stream
    s = stall_stream()
    doc = chrome_trace(s, {"type": "trace", "model": "m"})
    assert trace.to_chrome([{"type": "trace", "model": "m"}, *s]) == doc
    assert all("tid" in e and "pid" in e for e in doc["traceEvents"])
    steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert [e["name"] for e in steps] == [f"step {r['step']}" for r in metrics.steps(s)]


def test_the_chrome_trace_marks_each_lesson_where_it_stood_in_the_stream():
    """The app's lesson messages carry no engine time: each is marked at the last time before it in the stream
    (the end of the step before it), or, first in the stream, at the first time after it."""
    from app.readers.trace import chrome_trace
    from tests.factories import stall_stream
    s = stall_stream()
    recs = metrics.steps(s)
    lesson = lambda event: {"type": "lesson", "event": event, "lesson": 3, "text": "step3"}
    cut = next(i for i, o in enumerate(s) if o is recs[1])          # between the first two steps
    stream = [lesson("started"), *s[:cut], lesson("stopped"), *s[cut:], lesson("ended")]
    marks = [e for e in chrome_trace(stream)["traceEvents"] if e.get("cat") == "lesson"]
    first_t = min(o.get("t", o.get("t_start", 1e9)) for o in s)
    before_cut = max(o.get("t_end", o.get("t", -1)) for o in s[:cut])
    last_t = max(o.get("t_end", o.get("t", -1)) for o in s)
    assert [(m["name"], m["ts"]) for m in marks] == [("lesson 3 started", first_t * 1e6),
                                                      ("lesson 3 stopped", before_cut * 1e6),
                                                      ("lesson 3 ended", last_t * 1e6)]
    assert all(m["ph"] == "i" and m["tid"] == 0 and m["args"]["text"] == "step3" for m in marks)


def test_app_does_not_import_demos_and_metrics_need_no_torch():
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    code = ("import sys; import app, app.ui.page, app.replay.scenarios, app.readers.trace, app.ui.lessons, "
            "app.api.whatif_api, app.readers.report; "
            "bad = sorted(m for m in sys.modules if m == 'demos' or m.startswith('demos.')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=300)
    # app/readers/metrics.py on its own (the package's __init__ loads the engine, and torch with it)
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('m', 'app/readers/metrics.py'); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); assert 'torch' not in sys.modules; "
            "assert m.percentile([1, 2], 50) == 1.5")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_bench_ops_prints_its_tables(capsys):
    from demos.bench import ops as bench_ops
    from engine.kernels import cpu_kernels
    with torch.inference_mode():
        bench_ops.linears(1, rows=(1, 3))
        bench_ops.attention(1, cases=((1, 40), (3, 100)))
        if cpu_kernels.f32_linears():
            bench_ops.prefill(1, cases=((2, 30),))
    out = capsys.readouterr().out
    assert "| 3 |" in out and "| 3 x 100 |" in out and out.count("x |") >= 4
    if cpu_kernels.f32_linears():
        assert "F.linear / kernel" in out and "| 2 x 30 |" in out
