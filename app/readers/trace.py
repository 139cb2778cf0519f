"""Records -> Chrome trace events: the one converter (open the file in ui.perfetto.dev or chrome://tracing).

Used by the server's `/api/trace?format=chrome` and by `python -m demos.compare.trace`.
A `steps` track with one slice per step; one track per request (named by its
label) with a `decode` or `prefill N` slice for each step it was in and instant
markers for its lifecycle events; instants for policy changes and for the app's lesson
messages; counters for the queues, KV blocks and budget fill. Our times are seconds;
Chrome's are microseconds.
"""
from __future__ import annotations

from app.readers import metrics

US = 1e6
PID = 1


def chrome_trace(objs: list[dict], meta: dict | None = None) -> dict:
    """Chrome trace-event JSON of a stream (records in any order; a trace header is used as meta if none is given)."""
    tid = {req: i + 1 for i, req in enumerate(request_order(objs))}
    names = metrics.labels(objs)
    ev: list[dict] = [{"ph": "M", "pid": PID, "tid": 0, "name": "process_name", "args": {"name": "batchscope engine"}},
                      {"ph": "M", "pid": PID, "tid": 0, "name": "thread_name", "args": {"name": "steps"}}]
    for req, i in tid.items():
        ev.append({"ph": "M", "pid": PID, "tid": i, "name": "thread_name",
                   "args": {"name": f"{names.get(req, req)} ({req})"}})
        ev.append({"ph": "M", "pid": PID, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}})
    for rec in metrics.steps(objs):
        ev += step_events(rec, tid)
    for e in objs:
        if e.get("type") == "request":
            args = {k: v for k, v in e.items() if k not in ("type", "t")}
            ev.append({"ph": "i", "s": "t", "pid": PID, "tid": tid.get(e["req"], 0), "ts": e["t"] * US,
                       "name": e["event"], "cat": "request", "args": args})
        elif e.get("type") == "policy":
            ev.append({"ph": "i", "s": "p", "pid": PID, "tid": 0, "ts": e["t"] * US, "name": "policy",
                       "cat": "policy", "args": {k: v for k, v in e.items() if k not in ("type", "t")}})
    for e, t in lesson_times(objs):
        ev.append({"ph": "i", "s": "p", "pid": PID, "tid": 0, "ts": t * US, "cat": "lesson",
                   "name": f"lesson {e['lesson']} {e['event']}", "args": {k: v for k, v in e.items() if k != "type"}})
    if meta is None:
        meta = next((o for o in objs if o.get("type") == "trace"), None)
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": meta or {}}


def step_events(rec: dict, tid: dict[str, int]) -> list[dict]:
    """One step: its slice on the steps track, a slice per item on its request's track, three counters."""
    ts, dur, t_end = rec["t_start"] * US, max(rec["t_end"] - rec["t_start"], 0) * US, rec["t_end"] * US
    ev = [{"ph": "X", "pid": PID, "tid": 0, "ts": ts, "dur": dur, "cat": "step", "name": f"step {rec['step']}",
           "args": {k: rec.get(k) for k in ("policy", "num_tokens", "token_budget", "finished", "preempted",
                                            "stalled", "timing")} | {"items": len(rec["items"])}}]
    for item in rec["items"]:
        name = "decode" if item["kind"] == "decode" else f"prefill {item['tokens']}"
        ev.append({"ph": "X", "pid": PID, "tid": tid[item["req"]], "ts": ts, "dur": dur, "cat": item["kind"],
                   "name": name, "args": {**item, "step": rec["step"]}})
    kv = rec.get("kv") or {}
    ev += [{"ph": "C", "pid": PID, "tid": 0, "ts": t_end, "name": "queues",
            "args": {"waiting": rec.get("waiting", 0), "running": rec.get("running", 0)}},
           {"ph": "C", "pid": PID, "tid": 0, "ts": t_end, "name": "kv blocks",
            "args": {"used": kv.get("used", 0), "cached": kv.get("cached", 0)}},
           {"ph": "C", "pid": PID, "tid": 0, "ts": t_end, "name": "budget fill",
            "args": {"fill": rec["num_tokens"] / rec["token_budget"]}}]
    return ev


def lesson_times(objs: list[dict]) -> list[tuple[dict, float]]:
    """Each lesson message (app/ui/lessons.py; the app sends it without an engine time) with its place on the
    engine's clock: the latest time before it in the stream (a step's end, an event's time), or, where
    nothing timed comes before it, the stream's earliest time."""
    timed = ("step", "request", "policy")
    first = min((o.get("t_start", o.get("t")) for o in objs if o.get("type") in timed), default=None)
    out, latest = [], None
    for o in objs:
        if o.get("type") == "lesson" and first is not None:
            out.append((o, first if latest is None else latest))
        elif o.get("type") in timed:
            t = o.get("t_end", o.get("t"))
            latest = t if latest is None else max(latest, t)
    return out


def request_order(objs: list[dict]) -> list[str]:
    """Request ids in order of first appearance."""
    seen: dict[str, None] = {}
    for o in objs:
        if o.get("type") == "request":
            seen.setdefault(o["req"])
        elif o.get("type") == "step":
            for item in o["items"]:
                seen.setdefault(item["req"])
    return list(seen)
