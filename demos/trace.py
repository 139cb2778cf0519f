"""Trace files: save a run's record stream, load it back, convert it for Perfetto.

Our format (docs/step_record.md, "Trace files") is one JSON document: an array
of the objects the engine published, in the order it published them, with an
optional header object of type "trace" first. Anything that reads records
live reads a trace the same way.

    from demos import trace
    trace.save("out/run.json", run.stream, meta=run.meta)
    objs = trace.load("out/run.json")       # the list, header included (also reads {"records": [...]})
    trace.header(objs)                      # the header dict, or None
    trace.save_chrome("out/run.chrome.json", objs)   # open in ui.perfetto.dev or chrome://tracing

    python -m demos.trace out/run.json --chrome out/run.chrome.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine import metrics

KNOWN_TYPES = ("trace", "step", "request", "policy")


def save(path: str | Path, stream: list[dict], meta: dict | None = None):
    objs = ([{**meta, "type": "trace"}] if meta else []) + [o for o in stream if o.get("type") != "trace"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(objs, separators=(",", ":")))


def load(path: str | Path) -> list[dict]:
    objs = json.loads(Path(path).read_text())
    if isinstance(objs, dict) and isinstance(objs.get("records"), list):   # the app's /api/trace answer
        objs = objs["records"]
    if not isinstance(objs, list) or not all(isinstance(o, dict) and "type" in o for o in objs):
        raise ValueError(f"{path}: a trace is a JSON array of objects that each have a 'type'")
    return objs


def header(objs: list[dict]) -> dict | None:
    return next((o for o in objs if o.get("type") == "trace"), None)


# ---- Chrome trace events (Perfetto, chrome://tracing) ----
_US = 1e6   # our times are seconds; Chrome's are microseconds
_PID = 1


def to_chrome(objs: list[dict]) -> dict:
    """Chrome trace-event JSON: a 'steps' track, one track per request, counters for queues, KV and budget."""
    order = _request_order(objs)
    tid = {req: i + 1 for i, req in enumerate(order)}
    names = metrics.labels(objs)
    ev: list[dict] = [{"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": "batchscope engine"}},
                      {"ph": "M", "pid": _PID, "tid": 0, "name": "thread_name", "args": {"name": "steps"}}]
    for req, i in tid.items():
        ev.append({"ph": "M", "pid": _PID, "tid": i, "name": "thread_name",
                   "args": {"name": f"{names.get(req, req)} ({req})"}})
        ev.append({"ph": "M", "pid": _PID, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}})
    for rec in metrics.steps(objs):
        ts, dur = rec["t_start"] * _US, max(rec["t_end"] - rec["t_start"], 0) * _US
        ev.append({"ph": "X", "pid": _PID, "tid": 0, "ts": ts, "dur": dur, "cat": "step",
                   "name": f"step {rec['step']}",
                   "args": {k: rec.get(k) for k in ("policy", "num_tokens", "token_budget", "finished", "preempted",
                                                    "stalled", "timing")} | {"items": len(rec["items"])}})
        for item in rec["items"]:
            name = "decode" if item["kind"] == "decode" else f"prefill {item['tokens']}"
            ev.append({"ph": "X", "pid": _PID, "tid": tid[item["req"]], "ts": ts, "dur": dur, "cat": item["kind"],
                       "name": name, "args": {**item, "step": rec["step"]}})
        t_end = rec["t_end"] * _US
        ev.append({"ph": "C", "pid": _PID, "ts": t_end, "name": "queues",
                   "args": {"waiting": rec.get("waiting", 0), "running": rec.get("running", 0)}})
        kv = rec.get("kv") or {}
        ev.append({"ph": "C", "pid": _PID, "ts": t_end, "name": "kv blocks",
                   "args": {"used": kv.get("used", 0), "cached": kv.get("cached", 0)}})
        ev.append({"ph": "C", "pid": _PID, "ts": t_end, "name": "budget fill",
                   "args": {"fill": rec["num_tokens"] / rec["token_budget"]}})
    for e in objs:
        if e.get("type") == "request":
            args = {k: v for k, v in e.items() if k not in ("type", "t")}
            ev.append({"ph": "i", "s": "t", "pid": _PID, "tid": tid.get(e["req"], 0), "ts": e["t"] * _US,
                       "name": e["event"], "cat": "request", "args": args})
        elif e.get("type") == "policy":
            ev.append({"ph": "i", "s": "p", "pid": _PID, "tid": 0, "ts": e["t"] * _US, "name": "policy",
                       "cat": "policy", "args": {k: v for k, v in e.items() if k not in ("type", "t")}})
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": header(objs) or {}}


def save_chrome(path: str | Path, objs: list[dict]):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome(objs), separators=(",", ":")))


def _request_order(objs: list[dict]) -> list[str]:
    """Request ids in order of first appearance."""
    seen: dict[str, None] = {}
    for o in objs:
        if o.get("type") == "request":
            seen.setdefault(o["req"])
        elif o.get("type") == "step":
            for item in o["items"]:
                seen.setdefault(item["req"])
    return list(seen)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.trace", description="Convert a batchscope trace.")
    ap.add_argument("trace", help="a trace saved by demos.compare or the app (JSON array)")
    ap.add_argument("--chrome", required=True, help="write Chrome trace events here (open in Perfetto)")
    args = ap.parse_args(argv)
    save_chrome(args.chrome, load(args.trace))
    print(f"wrote {args.chrome}")


if __name__ == "__main__":
    main()
