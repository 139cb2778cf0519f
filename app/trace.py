"""Records -> Chrome trace events (open the file in ui.perfetto.dev or chrome://tracing).

One track for the engine's steps, one track per request showing the prefill
chunks and decodes it took part in, counters for the queues and the KV cache,
and instants for request events and policy changes. Times become microseconds.
"""
from __future__ import annotations

PID = 1


def chrome_trace(records: list[dict], meta: dict | None = None) -> dict:
    tids: dict[str, int] = {}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0,
                           "args": {"name": "batchscope engine"}},
                          {"name": "thread_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "steps"}}]

    def tid(req: str, label: str) -> int:
        if req not in tids:
            tids[req] = len(tids) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tids[req],
                           "args": {"name": f"{label} ({req})"}})
        return tids[req]

    for r in records:
        kind = r.get("type")
        if kind == "step":
            ts, dur = r["t_start"] * 1e6, max(r["t_end"] - r["t_start"], 0.0) * 1e6
            events.append({"name": f"step {r['step']}", "ph": "X", "pid": PID, "tid": 0, "ts": ts, "dur": dur,
                           "args": {k: r.get(k) for k in ("policy", "num_tokens", "token_budget", "finished",
                                                          "preempted", "stalled")}})
            for item in r["items"]:
                name = "decode" if item["kind"] == "decode" else f"prefill {item['tokens']}"
                events.append({"name": name, "ph": "X", "pid": PID, "tid": tid(item["req"], item["label"]),
                               "ts": ts, "dur": dur, "args": item})
            end = r["t_end"] * 1e6
            events.append({"name": "queue", "ph": "C", "pid": PID, "ts": end,
                           "args": {"waiting": r["waiting"], "running": r["running"]}})
            events.append({"name": "KV blocks used", "ph": "C", "pid": PID, "ts": end,
                           "args": {"used": r["kv"]["used"]}})
            events.append({"name": "tokens per step", "ph": "C", "pid": PID, "ts": ts,
                           "args": {"tokens": r["num_tokens"]}})
        elif kind == "request":
            args = {k: v for k, v in r.items() if k not in ("type", "t")}
            events.append({"name": r["event"], "ph": "i", "s": "t", "pid": PID, "tid": tid(r["req"], r["label"]),
                           "ts": r["t"] * 1e6, "args": args})
        elif kind == "policy":
            events.append({"name": f"policy {r['policy']}", "ph": "i", "s": "g", "pid": PID, "tid": 0,
                           "ts": r["t"] * 1e6, "args": {k: v for k, v in r.items() if k != "type"}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}
