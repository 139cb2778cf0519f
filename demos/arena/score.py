"""The scheduler arena: a policy of one's own against the built-in ones, scored on what users feel.

    batchscope arena my_policy.py                          # simulator, every seeded workload
    batchscope arena my_policy.py --workload long-documents --mode both   # + the real engine, and the gap
    batchscope arena my_policy.py --log session.json       # the class's own arrival log
    batchscope arena --rank submissions/ --workload chat-burst             # the lecturer's leaderboard

The policy file defines one policy (engine/scheduling/policy.py): a `policy` object, or exactly one
Policy subclass. It runs here, in this process, on the machine of whoever runs the command;
the web server never runs student code (docs/arena.md).

Score (app/readers/metrics.py): goodput, DistServe's share of requests that met both their TTFT
and their TBT SLO (demos/arena/workloads.py: limits in τ, the full-step time measured on
this machine), then output tokens/s and the longest stall. Modes: `sim` (the model-free
simulator driven by the step-cost fit: seconds), `real` (the engine: the score that counts),
`both` (each policy both ways, and how far the simulator was from the engine).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

from app.readers import metrics
from app.readers.analysis import CostFit, cost_points, fit_cost
from demos.arena.sim import Played, PolicyStuck, SimEngine, play, play_real, real_engine
from demos.arena.workloads import WORKLOADS, Job, Workload, class_log, get_workload, tau_of
from engine.scheduling.policies import BUILTINS
from engine.scheduling.policy import Policy, PolicyError

BUILTIN_NAMES = tuple(BUILTINS)
MODES = ("sim", "real", "both")
# how far the simulator may be from the real engine on totals over a run (tests/test_arena.py checks them on
# the tiny model; docs/arena.md quotes measured gaps). Goodput is not among them: it counts each request's
# longest gap, and one hiccup of a busy machine fails a request on the engine that the fit cannot foresee.
SIM_TOLERANCE = {"output_tokens_per_s": 0.35, "duration_s": 0.35}


class PolicyFileError(ValueError):
    """A policy file that cannot be used: the message says why and what to write instead."""


def load_policy(path: str | Path) -> Policy:
    """The one policy a file defines: its `policy` object (or class), else its single Policy subclass."""
    path = Path(path)
    if not path.is_file():
        raise PolicyFileError(f"{path}: no such policy file")
    spec = importlib.util.spec_from_file_location(f"arena_policy_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise PolicyFileError(f"{path}: the file raised {type(e).__name__}: {e}") from e
    obj = getattr(module, "policy", None)
    if obj is None:
        mine = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Policy)
                and v.__module__ == module.__name__]
        if len(mine) != 1:
            raise PolicyFileError(f"{path}: define `policy = MyPolicy()` or exactly one Policy subclass "
                                  f"(found {len(mine)}: {[c.__name__ for c in mine]})")
        obj = mine[0]
    if isinstance(obj, type) and issubclass(obj, Policy):
        obj = obj()
    if not isinstance(obj, Policy):
        raise PolicyFileError(f"{path}: `policy` must be an engine.scheduling.policy.Policy, got {type(obj).__name__}")
    if obj.name == Policy.name:
        obj.name = path.stem
    obj._arena_file = path.name
    return obj


# ---- the step cost and τ ----
def calibrate(engine_kwargs: dict, budget: int, max_num_seqs: int) -> CostFit:
    """Fit this machine's step cost on the real engine over the shapes the arena makes: replies of
    different lengths decoding side by side (1 to max_num_seqs of them, growing context), a long
    prompt chunked beside them, whole prompts alone."""
    n = min(12, max_num_seqs)
    sizes = [16 + 24 * i for i in range(n)] + [4 * budget, budget // 2 or 1]
    jobs = tuple(Job(0.0, f"cal{i}", tuple(range(1000 + 97 * i, 1000 + 97 * i + k)), 8 + 4 * (i % 8))
                 for i, k in enumerate(sizes))
    w = Workload("calibration", "step-cost calibration", jobs, token_budget=budget, max_num_seqs=max_num_seqs)
    engine = real_engine(w, engine_kwargs)
    run = play(engine, w, 0.0, sleep=time.sleep)
    engine.set_policy("continuous")                 # whole prompts alone, as continuous and static run them
    whole = Workload("calibration", "whole prompts",
                     tuple(Job(0.0, f"whole{k}", tuple(range(3000 + k, 3000 + k + m)), 2)
                           for k, m in enumerate((budget, 2 * budget, 3 * budget))),
                     token_budget=budget, max_num_seqs=max_num_seqs)
    run.stream += play(engine, whole, 0.0, sleep=time.sleep).stream
    return physical_fit(cost_points(run.stream), engine.device_dtype)


def physical_fit(points, device: str) -> CostFit:
    """app/readers/analysis.py's fit, with no negative cost (no step ever predicted below zero): when a
    coefficient comes out negative (noise on a busy machine) the context term is dropped, then the
    tokens term (a: the mean step)."""
    fit = fit_cost(points, device)
    if min(fit.a, fit.b, fit.c) < 0:
        fit = fit_cost([p._replace(context=0) for p in points], device)          # a + b*tokens
    if min(fit.a, fit.b) < 0:
        fit = fit_cost([p._replace(context=0, tokens=0) for p in points], device)  # a: the mean step
    return fit


def parse_cost(text: str) -> CostFit:
    """`a,b,c` seconds (per step, per token, per context token), or a JSON file with a, b, c (a report's fit)."""
    try:
        if Path(text).is_file():
            doc = json.loads(Path(text).read_text())
            doc = doc.get("fit", doc)
            a, b, c = doc["a"], doc["b"], doc["c"]
        else:
            a, b, c = (float(x) for x in text.split(","))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise SystemExit(f"--cost {text!r}: give a,b,c in seconds or a JSON file with a, b and c ({e})") from None
    return CostFit("given", a, b, c, None, 0, 3)


# ---- the score ----
def score(run: Played, workload: Workload, tau: float) -> dict:
    """Goodput (overall and per SLO class), tokens/s, the longest stall and the latency summary of a run."""
    slos = {rid: workload.slos[job.slo].limits(tau, len(job.prompt), workload.token_budget)
            for rid, job in run.jobs.items()}
    att = metrics.slo_attainment(run.stream, slos, run.due)
    s = metrics.summarize(run.stream, reqs=set(run.jobs))
    classes = sorted({job.slo for job in run.jobs.values()})
    return {
        "goodput": metrics.goodput(att),
        "goodput_by_slo": {c: metrics.goodput({r: a for r, a in att.items() if run.jobs[r].slo == c}) for c in classes},
        "ttft_met": sum(a["ttft_ok"] for a in att.values()) / len(att),
        "tbt_met": sum(a["tbt_ok"] for a in att.values()) / len(att),
        **{k: s[k] for k in ("output_tokens_per_s", "stall_max_s", "tbt_max_s", "tbt_p99_s", "ttft_p50_s",
                             "ttft_p99_s", "num_steps", "num_preemptions", "duration_s", "cached_prompt_tokens",
                             "output_tokens", "draft_tokens", "accepted_tokens")},
        "requests": att,
    }


def sim_gap(sim: dict, real: dict) -> dict:
    """How far the simulator was from the engine: goodput as a difference, the rest relative to the engine."""
    out = {"goodput": abs(sim["goodput"] - real["goodput"])}
    for k in ("output_tokens_per_s", "duration_s", "num_steps", "ttft_p50_s", "tbt_p99_s"):
        out[k] = abs(sim[k] - real[k]) / real[k] if sim.get(k) is not None and real.get(k) else None
    return out


def run_one(policy: Policy | str, workload: Workload, fit: CostFit, mode: str, engine_kwargs: dict) -> dict:
    """One policy on one workload: {"policy", "sim"/"real": {"score", "stream"}, "error"}."""
    name = policy if isinstance(policy, str) else policy.name
    fresh = (lambda: policy) if isinstance(policy, str) else (lambda: copy.deepcopy(policy))   # no state carried over
    tau = tau_of(fit, workload.token_budget)
    if not tau > 0:
        raise ValueError(f"the step-cost fit {fit} gives a full step no time: measure again or pass --cost a,b,c")
    out = {"policy": name, "error": None}
    try:
        if mode in ("sim", "both"):
            engine = SimEngine(workload, fit, fresh())
            engine.scheduler.cost_fit = fit
            run = play(engine, workload, tau)
            out["sim"] = {"score": score(run, workload, tau), "stream": run.stream, "wall_s": run.wall_s}
        if mode in ("real", "both"):
            run = play_real(workload, tau, fresh(), fit, engine_kwargs)
            out["real"] = {"score": score(run, workload, tau), "stream": run.stream, "wall_s": run.wall_s}
        if mode == "both":
            out["sim_gap"] = sim_gap(out["sim"]["score"], out["real"]["score"])
    except (PolicyError, PolicyStuck) as e:
        out["error"] = str(e)
    return out


def headline(result: dict) -> dict | None:
    """The score that counts: the real engine's where it ran, else the simulator's."""
    part = result.get("real") or result.get("sim")
    return part["score"] if part else None


def rank_key(result: dict):
    s = headline(result)
    if s is None:
        return (1, 0.0, 0.0, 0.0)
    return (0, -s["goodput"], -(s["output_tokens_per_s"] or 0.0), s["stall_max_s"] or 0.0)


# ---- the table ----
ROWS = [("goodput", "goodput (both SLOs met)", 100, "%"), ("ttft_met", "TTFT SLO met", 100, "%"),
        ("tbt_met", "TBT SLO met", 100, "%"), ("output_tokens_per_s", "output tokens/s", 1, ""),
        ("stall_max_s", "longest stall (ms)", 1e3, ""), ("ttft_p99_s", "TTFT p99 (ms)", 1e3, ""),
        ("tbt_p99_s", "TBT p99 (ms)", 1e3, ""), ("num_preemptions", "preemptions", 1, ""),
        ("num_steps", "steps", 1, "")]


def cell(v, scale, unit="") -> str:
    if v is None:
        return "–"
    x = v * scale
    return (f"{x:.0f}" if abs(x) >= 10 or float(x).is_integer() else f"{x:.2f}") + unit


def table(results: list[dict], part: str) -> str:
    cols = [r for r in results if r.get(part)]
    lines = [f"{'':28}" + "".join(f"{r['policy'][:15]:>16}" for r in cols)]
    for key, name, scale, unit in ROWS:
        lines.append(f"{name:28}" + "".join(f"{cell(r[part]['score'][key], scale, unit):>16}" for r in cols))
    classes = sorted({c for r in cols for c in r[part]["score"]["goodput_by_slo"]})
    for c in classes:
        lines.append(f"{'goodput, ' + c:28}" + "".join(
            f"{cell(r[part]['score']['goodput_by_slo'].get(c), 100, '%'):>16}" for r in cols))
    return "\n".join(lines)


def print_results(workload: Workload, results: list[dict], fit: CostFit, out=None):
    out = out or sys.stdout
    tau = tau_of(fit, workload.token_budget)
    print(f"\n== {workload.name}: {len(workload.jobs)} requests, budget {workload.token_budget}, "
          f"τ = {tau * 1e3:.1f} ms (step cost {fit.a * 1e3:.2f} ms + {fit.b * 1e6:.1f} µs/token "
          f"+ {fit.c * 1e9:.1f} ns/context token)", file=out)
    for part in ("sim", "real"):
        if any(r.get(part) for r in results):
            print(f"-- {'simulator' if part == 'sim' else 'real engine'}", file=out)
            print(table(results, part), file=out)
    for r in results:
        if r["error"]:
            print(f"!! {r['policy']}: {r['error']}", file=out)
        if r.get("sim_gap"):
            gap = ", ".join(f"{k} {v * 100:.0f}%" for k, v in r["sim_gap"].items() if v is not None)
            print(f"   simulator vs engine, {r['policy']}: {gap}", file=out)


def document(workloads: dict[str, tuple[Workload, list[dict]]], fit: CostFit, mode: str) -> dict:
    """The report's JSON: what ran, the scores, and each run's records (the leaderboard replays them)."""
    def part(p):
        return {"score": {k: v for k, v in p["score"].items() if k != "requests"}, "requests": p["score"]["requests"],
                "stream": p["stream"]} if p else None
    return {"type": "arena_report", "version": 1, "mode": mode, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "fit": fit._asdict(),
            "workloads": {name: {"description": w.description, "requests": len(w.jobs),
                                 "token_budget": w.token_budget, "max_num_seqs": w.max_num_seqs,
                                 "tau_s": tau_of(fit, w.token_budget),
                                 "slos": {k: vars(v) for k, v in w.slos.items()},
                                 "ranking": [r["policy"] for r in sorted(rs, key=rank_key)],
                                 "results": [{"policy": r["policy"], "error": r["error"], "sim": part(r.get("sim")),
                                              "real": part(r.get("real")), "sim_gap": r.get("sim_gap")}
                                             for r in rs]}
                          for name, (w, rs) in workloads.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="batchscope arena", description=__doc__.split("\n\n")[0])
    ap.add_argument("policy_file", nargs="?", help="a .py file that defines one policy (engine/scheduling/policy.py)")
    ap.add_argument("--rank", metavar="FOLDER", help="rank every .py policy file in FOLDER on one workload")
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS),
                    help="a seeded workload (repeatable; default: all, or chat-burst with --rank)")
    ap.add_argument("--log", help="the class's arrival log (GET /api/whatif/log) as one more workload")
    ap.add_argument("--mode", choices=MODES, default="sim")
    ap.add_argument("--cost", help="the step-cost fit `a,b,c` (seconds) or a report JSON; default: measure it")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the seeded workloads' prompts and replies")
    ap.add_argument("--model", default=None, help="model folder for the real engine and the calibration")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="out/arena.html", help="HTML report (the JSON goes beside it)")
    args = ap.parse_args(argv)
    if bool(args.policy_file) == bool(args.rank):
        ap.error("give one policy file, or --rank FOLDER")
    engine_kwargs = {k: v for k, v in dict(model=args.model, dtype=args.dtype, device=args.device).items() if v}

    try:
        mine = [load_policy(args.policy_file)] if args.policy_file else [
            load_policy(p) for p in sorted(Path(args.rank).glob("*.py")) if not p.name.startswith("_")]
    except PolicyFileError as e:
        print(f"batchscope arena: {e}", file=sys.stderr)
        return 2
    seen = set(BUILTIN_NAMES)
    for p in mine:                              # one name per column and per ranking row
        if p.name in seen:
            p.name = f"{p.name} ({getattr(p, '_arena_file', 'file')})"
        seen.add(p.name)
    if args.rank and not mine:
        print(f"batchscope arena: no policy files (*.py) in {args.rank}", file=sys.stderr)
        return 2
    names = args.workload or (["chat-burst"] if args.rank else list(WORKLOADS))
    workloads = [get_workload(n, args.scale) for n in names]
    fit = parse_cost(args.cost) if args.cost else calibrate(engine_kwargs, workloads[0].token_budget,
                                                           workloads[0].max_num_seqs)
    if args.log:
        try:
            workloads.append(class_log(args.log, fit))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"batchscope arena: --log {args.log}: {e}", file=sys.stderr)
            return 2
    done = {}
    for w in workloads:
        results = [run_one(p, w, fit, args.mode, engine_kwargs) for p in [*mine, *BUILTIN_NAMES]]
        if args.rank:
            results.sort(key=rank_key)
        print_results(w, results, fit)
        done[w.name] = (w, results)
    from demos.arena.report import write_arena_report
    doc = document(done, fit, args.mode)
    html_path = write_arena_report(args.out, doc)
    json_path = html_path.with_suffix(".json")
    json_path.write_text(json.dumps(doc))
    print(f"\nwrote {html_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
