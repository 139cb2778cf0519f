"""Run one scenario under several policies, each on a fresh engine, and compare.

    python -m demos.compare --scenario long-prompt-interrupts \\
        --policies static,continuous,chunked --out out/report.html --json out/metrics.json
    python -m demos.compare --trace saved.json --policies static,chunked    # a live session, replayed
    python -m demos.compare --scenario long-prompt-interrupts --policies chunked,disaggregated
    python -m demos.compare --scenario long-prompt-interrupts --policies chunked --vllm-start   # and vLLM's row

--trace takes an arrival log saved from the server (GET /api/whatif/log, presenter
key): the class's own requests, replayed at the steps they arrived under each
policy, as the server's what-if replay does (app/replay/whatif.py); the report also
shows what actually happened live.

`disaggregated` runs on a DisaggregatedEngine (engine/disagg/router.py): a prefill worker and
a decode worker, each with half the threads; its numbers add the KV hand-overs
(kv_transfers, kv_transfer_p50_s, kv_transfer_p99_s, kv_transfer_bytes).

--vllm URL (a running vLLM with the recording scheduler) or --vllm-start (one started from the
vLLM environment on the same model) adds vLLM's run of the same scenario: batchscope's engine then
runs with vLLM's token budget and sequence limit, and both print in one table (demos/vllm/side.py).

Writes a self-contained HTML report (app/readers/report.py) and a JSON file with, per
policy, the numbers of app.readers.metrics.summarize (ttft_p50_s, ttft_p99_s,
tbt_p50_s, tbt_p99_s, tbt_max_s, output_tokens_per_s, num_steps,
num_preemptions, ...). A scenario with a focus request (long-prompt-interrupts:
"Doc") also gets, per policy, the latencies of the requests that were decoding
when it arrived, and chunked-vs-continuous ratios of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from app.readers import metrics
from app.readers.report import fmt, write_report
from app.replay.arrival_log import from_saved
from app.replay.scenarios import SCENARIOS, Scenario, get_scenario
from app.replay.whatif import Replayed, to_scenario
from demos.compare import trace
from demos.compare.runner import Run, longest_prompt, run_scenario, warm_up
from demos.vllm import side as vllm_side
from engine import EngineConfig, LLMEngine
from engine.disagg.router import DisaggregatedEngine


def machine() -> dict:
    """What the numbers were measured on."""
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def run_policy(scenario: Scenario, policy: str, engine_kwargs: dict, warmup: bool = True,
               progress: bool = True) -> Run:
    """A fresh engine with the scenario's budgets (engine_kwargs override them), warmed up, then the scenario.
    `disaggregated`: a fresh pair of worker processes, closed after the run."""
    config = EngineConfig(**{**scenario.engine, **engine_kwargs, "policy": policy})
    engine = DisaggregatedEngine(config) if policy == "disaggregated" else LLMEngine(config)
    bar = tqdm(total=scenario.total_output_tokens, desc=f"{scenario.name} / {policy}", unit="tok",
               disable=not progress, file=sys.stderr, leave=True)

    def tick(obj):
        if obj.get("type") == "step":
            bar.update(sum(metrics.produces_token(i) for i in obj["items"]))
    try:
        if warmup:
            warm_up(engine, longest_prompt(engine, scenario))
        return run_scenario(engine, scenario, on_record=tick)
    finally:
        bar.close()
        if isinstance(engine, DisaggregatedEngine):
            engine.close()


def summarize_run(run: Run) -> dict:
    s = metrics.summarize(run.stream)
    if run.scenario.focus:
        s["focus"] = metrics.focus_summary(run.stream, run.request_of(run.scenario.focus))
    return s


def ratios(summaries: dict[str, dict], a: str = "chunked", b: str = "continuous") -> dict | None:
    """b / a for latencies (how many times lower under a), a / b for throughput."""
    if a not in summaries or b not in summaries:
        return None
    sa, sb = summaries[a], summaries[b]

    def div(x, y):
        return x / y if x is not None and y else None
    out = {f"{k}_{b}_over_{a}": div(sb[k], sa[k]) for k in ("ttft_p99_s", "tbt_p99_s", "tbt_max_s")}
    out[f"output_tokens_per_s_{a}_over_{b}"] = div(sa["output_tokens_per_s"], sb["output_tokens_per_s"])
    if "focus" in sa and "focus" in sb:
        for k in ("tbt_p99_s", "tbt_max_s", "stall_max_s"):
            out[f"victims_{k}_{b}_over_{a}"] = div(sb["focus"][k], sa["focus"][k])
    return out


def compare(scenario: Scenario, policies: list[str], engine_kwargs: dict | None = None, warmup: bool = True,
            progress: bool = True, trace_dir: str | None = None, repeats: int = 1
            ) -> tuple[dict[str, Run], dict[str, dict], dict[str, list[dict]]]:
    """Run every policy `repeats` times, interleaved (so a busy machine slows all of them alike).

    Returns the last run of each policy (for charts and traces), the median of
    each number over the repeats, and every repeat's numbers.
    """
    runs, each = {}, {p: [] for p in policies}
    for _ in range(repeats):
        for policy in policies:
            runs[policy] = run = run_policy(scenario, policy, engine_kwargs or {}, warmup, progress)
            each[policy].append(summarize_run(run))
    if trace_dir:
        for policy, run in runs.items():
            trace.save(Path(trace_dir) / f"{scenario.name}.{policy}.json", run.stream, meta=run.meta)
            trace.save_chrome(Path(trace_dir) / f"{scenario.name}.{policy}.chrome.json", [run.meta, *run.stream])
    return runs, {p: median_summary(ss) for p, ss in each.items()}, each


def vllm_run(vllm, scenario: Scenario, ours: dict[str, Run]) -> Run:
    """The scenario on a vLLM server (demos/vllm/side.py), as a Run like ours."""
    stream = vllm_side.run_scenario(vllm, scenario)
    meta = {**next(iter(ours.values())).meta, "policy": vllm.settings.get("policy"), "engine": vllm.hello.get("engine"),
            "device": vllm.hello.get("device")}
    return Run(scenario, meta, stream, vllm_side.request_ids(stream, [a.label for a in scenario.arrivals]))


def median_summary(summaries: list[dict]) -> dict:
    """Field by field median of several summaries (nested dicts too; other values from the first)."""
    out = {}
    for k, v in summaries[0].items():
        vals = [s.get(k) for s in summaries]
        if isinstance(v, dict):
            out[k] = median_summary(vals)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            nums = [x for x in vals if x is not None]
            out[k] = statistics.median(nums) if nums else None
        else:
            out[k] = v
    return out


def print_table(summaries: dict[str, dict], out=None):
    out = out or sys.stdout            # the stdout of the moment: a default bound at import goes stale
    rows = [("output tokens/s", "output_tokens_per_s", 1), ("TTFT p50 ms", "ttft_p50_s", 1e3),
            ("TTFT p99 ms", "ttft_p99_s", 1e3), ("TBT p50 ms", "tbt_p50_s", 1e3), ("TBT p99 ms", "tbt_p99_s", 1e3),
            ("TBT max ms", "tbt_max_s", 1e3), ("steps", "num_steps", None), ("preemptions", "num_preemptions", None)]
    if any(s.get("kv_transfers") for s in summaries.values()):     # disaggregated: the hand-overs
        rows += [("KV transfers", "kv_transfers", None), ("KV transfer p50 ms", "kv_transfer_p50_s", 1e3),
                 ("KV transfer p99 ms", "kv_transfer_p99_s", 1e3), ("KV MB moved", "kv_transfer_bytes", 1e-6)]
    focus = [("victims TBT p99 ms", "tbt_p99_s", 1e3), ("victims TBT max ms", "tbt_max_s", 1e3),
             ("victims longest stall ms", "stall_max_s", 1e3)]
    print(f"{'':28}" + "".join(f"{p:>14}" for p in summaries), file=out)
    for name, key, scale in rows:
        print(f"{name:28}" + "".join(f"{fmt(s[key], scale):>14}" for s in summaries.values()), file=out)
    if all("focus" in s for s in summaries.values()):
        for name, key, scale in focus:
            print(f"{name:28}" + "".join(f"{fmt(s['focus'][key], scale):>14}" for s in summaries.values()), file=out)


def markdown(doc: dict) -> str:
    """The JSON document of a comparison as a markdown table (docs/results.md is pasted from this)."""
    pols = doc["policies"]
    m = doc["machine"]
    rows = [("output tokens/s", "output_tokens_per_s", 1, 1), ("TTFT p50 (ms)", "ttft_p50_s", 1e3, 0),
            ("TTFT p99 (ms)", "ttft_p99_s", 1e3, 0), ("TBT p50 (ms)", "tbt_p50_s", 1e3, 0),
            ("TBT p99 (ms)", "tbt_p99_s", 1e3, 0), ("TBT max (ms)", "tbt_max_s", 1e3, 0),
            ("steps", "num_steps", 1, 0), ("preemptions", "num_preemptions", 1, 0)]
    if any(s.get("kv_transfers") for s in pols.values()):
        rows += [("KV transfers", "kv_transfers", 1, 0), ("KV transfer p50 (ms)", "kv_transfer_p50_s", 1e3, 0),
                 ("KV transfer p99 (ms)", "kv_transfer_p99_s", 1e3, 0), ("KV moved (MB)", "kv_transfer_bytes", 1e-6, 1)]
    focus = [("their TBT p99 (ms)", "tbt_p99_s", 1e3, 0), ("their longest gap (ms)", "tbt_max_s", 1e3, 0),
             ("their longest stall (ms)", "stall_max_s", 1e3, 0), ("TTFT of the newcomer (ms)", "focus_ttft_s", 1e3, 0)]

    def cell(v, scale, nd):
        return "–" if v is None else f"{v * scale:,.{nd}f}"
    lines = [f"{doc['scenario']}: {doc['model']}, {doc['dtype']} on {doc['device']} ({m['cpu']}, {m['cpu_count']} "
             f"cores, {doc.get('threads', '?')} torch thread(s)), token budget "
             f"{doc['engine']['max_num_batched_tokens']}, {m['date']}; medians of {doc.get('repeats', 1)} run(s) "
             "per policy.", "", "| | " + " | ".join(pols) + " |", "|---|" + "---:|" * len(pols)]
    for name, key, scale, nd in rows:
        lines.append(f"| {name} | " + " | ".join(cell(s.get(key), scale, nd) for s in pols.values()) + " |")
    if all("focus" in s for s in pols.values()):
        lines.append("| **requests decoding when the newcomer arrived** | "
                     + " | ".join(", ".join(s["focus"]["victim_labels"]) for s in pols.values()) + " |")
        for name, key, scale, nd in focus:
            lines.append(f"| {name} | " + " | ".join(cell(s["focus"].get(key), scale, nd) for s in pols.values())
                         + " |")
    return "\n".join(lines) + "\n"


def saved_session(path: str) -> tuple[Scenario, Replayed]:
    """A saved arrival log -> (its arrivals as a step-clock scenario under the live budgets, the live run)."""
    try:
        doc = json.loads(Path(path).read_text())
        logged = from_saved(doc)
    except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--trace {path}: {e}") from None
    live = doc.get("settings", {})
    budgets = {k: live[k] for k in ("max_num_batched_tokens", "max_num_seqs") if live.get(k)}
    scenario = to_scenario(logged, name=f"live session ({Path(path).name})")
    scenario = Scenario(scenario.name, scenario.description, scenario.arrivals, engine=budgets)
    meta = {"model": doc.get("model"), "dtype": doc.get("dtype"), "device": doc.get("device"),
            "created": doc.get("created", ""), **{k: live.get(k) for k in
                                                   ("policy", "max_num_batched_tokens", "max_num_seqs")}}
    return scenario, Replayed(meta, doc.get("records", []))


def parse_params(items: list[str]) -> dict:
    """--param k=v pairs for the scenario factory; numbers become numbers."""
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        if not _:
            raise SystemExit(f"--param needs key=value, got {item!r}")
        for cast in (int, float):
            try:
                v = cast(v)
                break
            except ValueError:
                pass
        out[k] = v
    return out


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.compare", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", choices=list(SCENARIOS))
    src.add_argument("--trace", default=None, help="an arrival log saved from the server (GET /api/whatif/log)")
    ap.add_argument("--policies", default="static,continuous,chunked")
    ap.add_argument("--out", default="out/report.html", help="HTML report")
    ap.add_argument("--json", default=None, help="metrics JSON")
    ap.add_argument("--traces", default=None, help="folder for one trace per policy (ours and Chrome's)")
    ap.add_argument("--model", default=None, help="local model folder or Hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the engine's auto)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-warmup", action="store_true", help="skip the throwaway request before each policy")
    ap.add_argument("--param", action="append", default=[], help="scenario parameter key=value (repeatable)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--md", default=None, help="also write the table as markdown here")
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy; the tables report medians")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    vllm_side.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    actual = None
    if args.trace:
        scenario, actual = saved_session(args.trace)
    else:
        scenario = get_scenario(args.scenario, **parse_params(args.param))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    kw = {k: v for k, v in dict(model=args.model, dtype=args.dtype, device=args.device,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                max_num_seqs=args.max_num_seqs).items() if v is not None}
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    vllm = vllm_side.named(args)
    if vllm is not None:                    # ours run under vLLM's budgets and dtype: one schedule shape, one model
        kw.update({k: vllm.settings[k] for k in ("max_num_batched_tokens", "max_num_seqs")}, dtype=vllm.dtype)
        print(f"{vllm.name}: budget {kw['max_num_batched_tokens']}, max_num_seqs {kw['max_num_seqs']}, "
              f"{vllm.dtype} (batchscope's engine runs with the same)", file=sys.stderr)
    elif args.vllm_start:                   # one dtype on both (batchscope's "auto" may pick bfloat16)
        kw.setdefault("dtype", "float32")
    runs, summaries, each = compare(scenario, policies, kw, warmup=not args.no_warmup, progress=not args.quiet,
                                    trace_dir=args.traces, repeats=args.repeats)
    budgets = {**{f.name: f.default for f in dataclasses.fields(EngineConfig)}, **scenario.engine, **kw}
    with vllm_side.serving(args, vllm, args.model, budgets["max_num_batched_tokens"], budgets["max_num_seqs"],
                           budgets.get("max_prefill_chunk"), kw.get("dtype", "float32")) as vllm:
        if vllm is not None:
            vruns = [vllm_run(vllm, scenario, runs) for _ in range(args.repeats)]
            runs[vllm.name] = vruns[-1]
            each[vllm.name] = [summarize_run(r) for r in vruns]
            summaries[vllm.name] = median_summary(each[vllm.name])
    print_table(summaries)
    if vllm is not None:
        print(vllm_side.table(list(summaries.items())))
    r = ratios(summaries)
    if r:
        print("chunked vs continuous: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items() if v is not None))
    meta = next(iter(runs.values())).meta
    if actual is not None:                  # what happened live, first
        runs = {f"actual ({actual.meta['policy']})": actual, **runs}
        live_reqs = {e["req"] for e in metrics.events(actual.stream, "arrived")}   # not earlier requests in flight
        summaries = {next(iter(runs)): metrics.summarize(actual.stream, live_reqs), **summaries}
    path = write_report(args.out, scenario, runs, summaries, repeats=args.repeats)
    print(f"wrote {path}")
    if args.json:
        doc = {"scenario": scenario.name, "params": parse_params(args.param), "model": meta["model"],
               "dtype": meta["dtype"], "device": meta["device"], "machine": machine(),
               "engine": {k: meta[k] for k in ("max_num_batched_tokens", "max_num_seqs", "attention_backend")},
               "threads": torch_threads(), "repeats": args.repeats, "policies": summaries, "ratios": r,
               "each_run": each if args.repeats > 1 else None}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
        if args.md:
            Path(args.md).write_text(markdown(doc))
            print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
