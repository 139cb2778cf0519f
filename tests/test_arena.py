"""The scheduler arena: policy files, the simulator, the score, the real engine beside the simulator, the CLI."""
import json
import math
import textwrap

import pytest

from app.cli import main as cli
from app.readers import metrics
from app.readers.analysis import CostFit
from demos.arena.score import SIM_TOLERANCE, PolicyFileError, load_policy, run_one, sim_gap
from demos.arena.workloads import WORKLOADS, Job, Workload, get_workload, tau_of
from engine.scheduling.policy import Policy

FIT = CostFit("given", 0.01, 0.0005, 1e-6, None, 0, 3)
EXAMPLES = ("demos/arena/policies/shortest_prompt_first.py", "demos/arena/policies/long_prefill_threshold.py",
            "engine/scheduling/policies/chunked.py", "engine/scheduling/policies/static.py",
            "engine/scheduling/policies/continuous.py")


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_policy_file_gives_its_one_policy(tmp_path):
    one = write(tmp_path, "mine.py", """
        from engine.scheduling.policy import Policy
        class Mine(Policy):
            def schedule(self, step):
                return [(r, 1) for r in step.decodes]
        """)
    p = load_policy(one)
    assert isinstance(p, Policy) and p.name == "mine"          # named after its file when it has no name
    two = write(tmp_path, "two.py", """
        from engine.scheduling.policy import Policy
        class A(Policy): pass
        class B(Policy): pass
        """)
    with pytest.raises(PolicyFileError, match="exactly one Policy subclass"):
        load_policy(two)
    broken = write(tmp_path, "broken.py", "import no_such_module\n")
    with pytest.raises(PolicyFileError, match="ModuleNotFoundError"):
        load_policy(broken)
    with pytest.raises(PolicyFileError, match="must be an engine.scheduling.policy.Policy"):
        load_policy(write(tmp_path, "wrong.py", "policy = 3\n"))


@pytest.mark.parametrize("path", EXAMPLES)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_example_policy_finishes_every_workload(path, workload):
    w = get_workload(workload, scale=0.25)
    r = run_one(load_policy(path), w, FIT, "sim", {})
    assert r["error"] is None, r["error"]
    s = r["sim"]["score"]
    assert 0 <= s["goodput"] <= 1 and len(s["requests"]) == len(w.jobs)
    done = {e["req"] for e in r["sim"]["stream"] if e.get("event") == "finished"}
    assert len(done) == len(w.jobs)
    assert sum(len(tk) for tk in metrics.tokens(r["sim"]["stream"]).values()) == w.output_tokens


def test_the_simulator_is_deterministic_and_timed_by_the_fit():
    w = get_workload("long-documents", scale=0.25)
    a, b = (run_one("chunked", w, FIT, "sim", {})["sim"] for _ in range(2))
    assert a["score"] == b["score"]
    for rec in metrics.steps(a["stream"]):
        ctx = sum(it["start"] + it["tokens"] for it in rec["items"])
        want = FIT.a + FIT.b * rec["num_tokens"] + FIT.c * ctx if rec["items"] else 0.0
        assert math.isclose(rec["t_end"] - rec["t_start"], want, rel_tol=1e-9, abs_tol=1e-12)


def test_goodput_is_the_share_that_met_both_slos():
    def step(i, t, items):
        return {"type": "step", "step": i, "t_start": t - 0.1, "t_end": t, "items": items}
    dec = lambda r: {"req": r, "kind": "decode", "tokens": 1, "start": 5}
    first = lambda r: {"req": r, "kind": "prefill", "tokens": 5, "start": 0, "completes_prompt": True}
    stream = [{"type": "request", "event": "arrived", "req": r, "label": r, "t": 0.0} for r in "abc"]
    stream += [step(0, 1.0, [first("a"), first("b")]), step(1, 1.5, [dec("a"), dec("b")]),
               step(2, 4.0, [dec("a"), first("c")]), step(3, 4.2, [dec("b"), dec("c")])]
    att = metrics.slo_attainment(stream, {r: (2.0, 1.0) for r in "abc"} | {"d": (9.0, 9.0)})
    assert [att[r]["ok"] for r in "abcd"] == [False, False, False, False]     # a: gap 2.5; b: gap 2.7; c: TTFT 4
    assert att["a"]["ttft_ok"] and not att["a"]["tbt_ok"] and att["c"]["tbt_ok"] and att["d"]["ttft_s"] is None
    att = metrics.slo_attainment(stream, {r: (4.0, 3.0) for r in "abc"}, due={"c": 1.0})
    assert metrics.goodput(att) == 1.0 and att["c"]["ttft_s"] == 3.0


def test_a_policy_that_breaks_a_rule_is_disqualified_with_the_rule_named(tmp_path):
    greedy = load_policy(write(tmp_path, "greedy.py", """
        from engine.scheduling.policy import Policy
        class Greedy(Policy):
            name = "greedy"
            def schedule(self, step):
                return [(r, r.remaining) for r in step.running + step.waiting]
        """))
    r = run_one(greedy, get_workload("long-documents", scale=0.25), FIT, "sim", {})
    assert "broke rule `budget`" in r["error"] and "at step" in r["error"] and "request r" in r["error"]


def test_a_policy_that_runs_nothing_is_stopped(tmp_path):
    idle = load_policy(write(tmp_path, "idle.py", """
        from engine.scheduling.policy import Policy
        class Idle(Policy):
            def schedule(self, step):
                return []
        """))
    r = run_one(idle, get_workload("chat-burst", scale=0.25), FIT, "sim", {})
    assert "ran nothing for 201 steps" in r["error"]


def test_cli_scores_a_policy_file_and_ranks_a_folder(tmp_path, capsys):
    out = tmp_path / "report.html"
    rc = cli(["arena", "demos/arena/policies/shortest_prompt_first.py", "--workload", "chat-burst", "--workload",
              "long-documents", "--cost", "0.01,0.0005,0.000001", "--scale", "0.25", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "== chat-burst" in text and "== long-documents" in text
    for name in ("shortest-prompt", "static", "continuous", "chunked", "goodput (both SLOs met)"):
        assert name in text
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["type"] == "arena_report" and set(doc["workloads"]) == {"chat-burst", "long-documents"}
    res = doc["workloads"]["chat-burst"]["results"]
    assert [r["policy"] for r in res] == ["shortest-prompt-first", "static", "continuous", "chunked"]
    assert all(r["sim"]["stream"] and r["real"] is None for r in res)
    page = out.read_text()
    assert page.count("plotly-graph-div") >= 2 * (1 + 4 + 1) and "Goodput per SLO class" in page
    # the lecturer's ranking: a folder of submissions, a broken one last with its rule named
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "spf.py").write_text(open("demos/arena/policies/shortest_prompt_first.py").read())
    write(subs, "greedy.py", """
        from engine.scheduling.policy import Policy
        class Greedy(Policy):
            def schedule(self, step):
                return [(r, r.remaining) for r in step.running + step.waiting]
        """)
    rc = cli(["arena", "--rank", str(subs), "--cost", "0.01,0.0005,0.000001", "--scale", "0.25",
              "--out", str(tmp_path / "rank.html")])
    assert rc == 0
    doc = json.loads((tmp_path / "rank.json").read_text())
    ranking = doc["workloads"]["chat-burst"]["ranking"]
    assert ranking[-1] == "greedy" and len(ranking) == 5
    assert "broke rule `budget`" in capsys.readouterr().out
    assert cli(["arena", "--rank", str(tmp_path / "empty_nowhere")]) == 2


def test_the_simulator_takes_the_real_engines_steps(tmp_path):
    """With every arrival at the start (no timing in the decisions), the simulator and the real engine run
    the very same steps; fed the step-cost fit of the real run, the simulator's totals are the engine's
    within SIM_TOLERANCE (the fit's own error: on a busy machine a fit taken a minute earlier can be off
    by more, which docs/arena.md reports)."""
    from app.readers.analysis import cost_points
    from demos.arena.score import physical_fit
    from tests.helpers import save_tiny_model
    kw = {"model": str(save_tiny_model("llama", tmp_path / "m"))}
    jobs = tuple(Job(0.0, f"u{i}", tuple(range(2000 + 50 * i, 2000 + 50 * i + n)), 6 + i % 4)
                 for i, n in enumerate((20, 150, 40, 300, 12, 60)))
    w = Workload("at-once", "every request at the start", jobs, token_budget=64, max_num_seqs=4, num_kv_blocks=48)
    for policy in ("chunked", "continuous"):
        real = run_one(policy, w, FIT, "real", kw)["real"]
        fit = physical_fit(cost_points(real["stream"]), "cpu/float32")
        sim = run_one(policy, w, fit, "sim", kw)["sim"]
        plans = [[[(it["label"], it["tokens"]) for it in rec["items"]] for rec in metrics.steps(part["stream"])]
                 for part in (sim, real)]
        assert plans[0] == plans[1]
        gap = sim_gap(sim["score"], real["score"])
        assert gap["num_steps"] == 0
        for k in SIM_TOLERANCE:
            assert gap[k] <= SIM_TOLERANCE[k], (policy, k, gap, fit)


def test_the_class_log_is_a_workload_on_the_live_machines_clock(tmp_path):
    """Arrival times of a saved log are read in τ of the machine that served them (from its own records)."""
    from demos.arena.workloads import class_log
    from engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=20).__dict__
    arrivals = [{"req": f"r{i}", "label": name, "t": 10.0 + t, "step": i, "prompt_token_ids": list(range(100, 100 + n)),
                 "params": params, "output_tokens": 5} for i, (name, t, n) in
                enumerate((("Ann", 0.0, 30), ("Doc", 0.9, 600), ("Bob", 1.8, 12)))]
    # the live machine: a step costs 0.05 s + 1 ms per token, so a full step of 64 tokens (τ) is 0.114 s
    records = [{"type": "step", "step": k, "t_start": 0.0, "t_end": 0.05 + 0.001 * n, "num_tokens": n,
                "items": [{"req": "x", "kind": "prefill", "tokens": n, "start": 0}]}
               for k, n in enumerate((1, 8, 30, 64))]
    records[-1]["items"][0]["start"] = 5                       # context apart from tokens, so the fit has its c term
    doc = {"type": "arrival_log", "settings": {"max_num_batched_tokens": 64, "max_num_seqs": 4},
           "arrivals": arrivals, "records": records}
    (tmp_path / "log.json").write_text(json.dumps(doc))
    w = class_log(str(tmp_path / "log.json"))
    assert (w.token_budget, w.max_num_seqs) == (64, 4)
    tau = tau_of(CostFit("", 0.05, 0.001, 0.0, None, 0, 3), 64)
    assert [(j.label, j.slo, j.max_tokens) for j in w.jobs] == [("Ann", "chat", 5), ("Doc", "document", 5),
                                                                 ("Bob", "chat", 5)]
    assert [j.at for j in w.jobs] == pytest.approx([0.0, 0.9 / tau, 1.8 / tau], abs=2e-3)
    r = run_one("chunked", w, FIT, "sim", {})
    assert r["error"] is None and len(r["sim"]["score"]["requests"]) == 3
    rc = cli(["arena", "engine/scheduling/policies/chunked.py", "--workload", "chat-burst", "--scale", "0.25", "--cost",
              "0.01,0.0005,0", "--log", str(tmp_path / "log.json"), "--out", str(tmp_path / "r.html")])
    doc = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and set(doc["workloads"]) == {"chat-burst", "class-log"}
    # a file named like a built-in gets a column of its own
    assert [r["policy"] for r in doc["workloads"]["class-log"]["results"]] == [
        "chunked (chunked.py)", "static", "continuous", "chunked"]


def test_the_docs_example_policy_runs_every_workload():
    """docs/arena.md's first example and engine/scheduling/policy.py's are the same policy, and it works."""
    import re
    from pathlib import Path
    docs = re.search(r"```python\n(.*?)```", Path("docs/arena.md").read_text(), re.S).group(1)
    ns = {}
    exec(compile(docs, "docs/arena.md", "exec"), ns)
    import engine.scheduling.policy
    def lines(text):
        return "\n".join(line.strip() for line in text.splitlines() if line.strip())
    assert lines(docs.split("\npolicy = ")[0]) in lines(engine.scheduling.policy.__doc__)
    for name in WORKLOADS:
        r = run_one(ns["policy"], get_workload(name, scale=0.25), FIT, "sim", {})
        assert r["error"] is None, r["error"]


def test_the_simulator_switches_prefix_caching_off_and_caps_the_kv_cache():
    """Lesson 6's and 7's settings as workload settings: with prefix caching off nothing is cached and every
    prompt is computed; under a KV cap requests are preempted and no step uses more blocks than the cap."""
    from dataclasses import replace
    w = get_workload("shared-system-prompt", scale=0.25)
    on, off = (run_one("chunked", replace(w, enable_prefix_caching=flag), FIT, "sim", {})["sim"]
               for flag in (True, False))
    assert on["score"]["cached_prompt_tokens"] > 0 and off["score"]["cached_prompt_tokens"] == 0
    assert all(r.get("prefix_caching") is False for r in metrics.steps(off["stream"]))
    prefill = [sum(i["tokens"] for r in metrics.steps(p["stream"]) for i in r["items"] if i["kind"] == "prefill")
               for p in (on, off)]
    assert prefill[1] == prefill[0] + on["score"]["cached_prompt_tokens"]
    jobs = tuple(Job(0.0, f"u{i}", tuple(range(2000 + 50 * i, 2040 + 50 * i)), 64) for i in range(8))
    whole = Workload("memory", "eight long replies at once", jobs, token_budget=256, max_num_seqs=16, num_kv_blocks=128)
    capped = replace(whole, max_kv_blocks=24)
    full, cap = (run_one("chunked", x, FIT, "sim", {})["sim"] for x in (whole, capped))
    assert full["score"]["num_preemptions"] == 0 < cap["score"]["num_preemptions"]
    assert all(r["kv"]["limit"] == 24 and r["kv"]["used"] <= 24 for r in metrics.steps(cap["stream"]))
    assert cap["score"]["output_tokens"] == full["score"]["output_tokens"] == whole.output_tokens
    assert cap["score"]["draft_tokens"] == 0                # the simulator never drafts (docs/arena.md)
    with pytest.raises(ValueError, match="under its cap"):
        replace(whole, max_kv_blocks=4)


def test_records_of_the_new_lessons_do_not_break_the_score(tmp_path):
    """A real engine with lesson 8's speculation, a prefix shared by every prompt and lesson 7's kind of KV
    cap, scored as the arena scores: its drafted, accepted and cached items, preemptions and the cap's limit
    are counted, every token of every request is there, and the report is written. Its records in a saved
    log give the class-log workload its τ and its cache settings (the speculation is named, not replayed)."""
    from app.replay.scenarios import LESSON_SPECULATION
    from demos.arena.report import write_arena_report
    from demos.arena.score import document, score
    from demos.arena.sim import play
    from demos.arena.workloads import class_log
    from engine import EngineConfig, LLMEngine
    from tests.helpers import save_tiny_model
    model = str(save_tiny_model("llama", tmp_path / "m"))
    shared = tuple(range(3000, 3032)) * 2
    jobs = tuple(Job(0.0, f"u{i}", shared + tuple(range(5000 + 7 * i, 5008 + 7 * i)), 40) for i in range(6))
    w = Workload("lessons", "a shared prefix, long replies, a small cache", jobs, token_budget=64, max_num_seqs=8,
                 num_kv_blocks=64, max_kv_blocks=16)
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", policy="chunked", max_num_batched_tokens=64,
                                    max_num_seqs=8, num_kv_blocks=64, speculative_config=LESSON_SPECULATION))
    engine.set_policy(max_kv_blocks=16)
    tau = tau_of(FIT, w.token_budget)
    run = play(engine, w, tau, sleep=lambda s: None)
    steps = metrics.steps(run.stream)
    assert any(i.get("drafted") for r in steps for i in r["items"]), "the tiny model's replies gave no draft"
    s = score(run, w, tau)
    assert s["draft_tokens"] > 0 and s["accepted_tokens"] <= s["draft_tokens"]
    assert s["cached_prompt_tokens"] > 0 and s["num_preemptions"] > 0
    assert all(r["kv"]["limit"] == 16 for r in steps)
    assert s["output_tokens"] == w.output_tokens and len(s["requests"]) == len(jobs)
    assert all(a["ttft_s"] is not None and a["longest_tbt_s"] is not None for a in s["requests"].values())
    assert 0.0 <= s["goodput"] <= 1.0
    result = {"policy": "chunked", "error": None, "real": {"score": s, "stream": run.stream, "wall_s": run.wall_s}}
    assert write_arena_report(tmp_path / "r.html", document({"lessons": (w, [result])}, FIT, "real")).is_file()

    settings = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "enable_prefix_caching": False,
                "max_kv_blocks": 16, "speculative_config": LESSON_SPECULATION}
    arrivals = [{"req": rid, "label": job.label, "t": run.due[rid], "step": k, "prompt_token_ids": list(job.prompt),
                 "params": {"max_tokens": job.max_tokens}, "output_tokens": job.max_tokens}
                for k, (rid, job) in enumerate(run.jobs.items())]
    (tmp_path / "log.json").write_text(json.dumps({"type": "arrival_log", "settings": settings,
                                                   "arrivals": arrivals, "records": run.stream}))
    log = class_log(str(tmp_path / "log.json"))
    assert log.enable_prefix_caching is False and log.max_kv_blocks == 16 and "without it" in log.description
    replayed = run_one("chunked", log, FIT, "sim", {})
    assert replayed["error"] is None and replayed["sim"]["score"]["output_tokens"] == w.output_tokens
    assert replayed["sim"]["score"]["cached_prompt_tokens"] == 0
