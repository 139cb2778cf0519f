"""Serving metrics, computed from the record stream alone.

Input everywhere is a *stream*: the list of objects the engine publishes (step
records and request events, in any order; other types are ignored). A live
subscription, a saved trace and a GPU run give the same numbers.

One definition of each metric (docs/step_record.md):
  token time  t_end of a step in which one of the request's items produced a
              token: a decode item, or a prefill item with completes_prompt.
  TTFT        first token time - arrival time (the request's "arrived" event).
  TBT         gap between consecutive tokens of one request (vLLM's ITL).
  stall       a TBT during which at least one step left the request out
              (its consecutive tokens are more than one step apart).
  output tokens/s   all output tokens / (last token time - first arrival).
  budget fill step num_tokens / token_budget (above 1 when a whole prompt
              longer than the budget runs in one step).

    from demos import metrics
    metrics.summarize(stream)                    # the numbers of docs/results.md
    metrics.summarize(stream, reqs={"r0", "r1"}) # latencies of some requests only
    metrics.tbts(stream)["r0"]                   # [s, s, ...]
    metrics.decoding_at(stream, t)               # requests with a reply under way at time t

Percentiles interpolate linearly between order statistics (numpy's default).
Empty samples give None.
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def steps(stream: Iterable[dict]) -> list[dict]:
    """The step records, in step order."""
    return sorted((r for r in stream if r.get("type") == "step"), key=lambda r: r["step"])


def events(stream: Iterable[dict], event: str | None = None) -> list[dict]:
    """Request events (of one kind when `event` is given), in time order."""
    return sorted((r for r in stream if r.get("type") == "request" and (event is None or r["event"] == event)),
                  key=lambda r: r["t"])


def produces_token(item: dict) -> bool:
    return item["kind"] == "decode" or bool(item.get("completes_prompt"))


def token_log(stream: Iterable[dict]) -> dict[str, list[tuple[int, float]]]:
    """req -> [(step, time)] of each output token, in order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in steps(stream):
        for item in rec["items"]:
            if produces_token(item):
                out.setdefault(item["req"], []).append((rec["step"], rec["t_end"]))
    return out


def token_times(stream: Iterable[dict]) -> dict[str, list[float]]:
    return {req: [t for _, t in log] for req, log in token_log(stream).items()}


def arrivals(stream: Iterable[dict]) -> dict[str, float]:
    return {e["req"]: e["t"] for e in events(stream, "arrived")}


def labels(stream: Iterable[dict]) -> dict[str, str]:
    """req -> label, from events and step items."""
    out = {e["req"]: e["label"] for e in events(stream) if "label" in e}
    for rec in steps(stream):
        for item in rec["items"]:
            out.setdefault(item["req"], item.get("label", item["req"]))
    return out


def ttfts(stream: Iterable[dict]) -> dict[str, float]:
    """req -> TTFT, for requests whose arrival and first token are both in the stream."""
    arr, times = arrivals(stream), token_times(stream)
    return {req: times[req][0] - arr[req] for req in times if req in arr}


def tbts(stream: Iterable[dict]) -> dict[str, list[float]]:
    """req -> gaps between its consecutive tokens."""
    return {req: [b - a for a, b in zip(ts, ts[1:])] for req, ts in token_times(stream).items()}


def stalls(stream: Iterable[dict]) -> dict[str, list[tuple[int, float]]]:
    """req -> [(step of the token that ended the stall, stall length)]: TBTs that spanned a step leaving it out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for req, log in token_log(stream).items():
        out[req] = [(s1, t1 - t0) for (s0, t0), (s1, t1) in zip(log, log[1:]) if s1 - s0 > 1]
    return out


def tbt_series(stream: Iterable[dict], reqs: Iterable[str] | None = None) -> list[tuple[float, float, str]]:
    """(token time, TBT, req) for every token after the first, sorted by time: TBT over time."""
    keep = set(reqs) if reqs is not None else None
    rows = [(ts[i], ts[i] - ts[i - 1], req) for req, ts in token_times(stream).items()
            if keep is None or req in keep for i in range(1, len(ts))]
    return sorted(rows)


def budget_fill(stream: Iterable[dict]) -> list[tuple[int, float, float]]:
    """(step, t_end, num_tokens / token_budget) per step."""
    return [(r["step"], r["t_end"], r["num_tokens"] / r["token_budget"]) for r in steps(stream)]


def decoding_at(stream: Iterable[dict], t: float) -> list[str]:
    """Requests with a reply under way at time t: first token at or before t, another token after it."""
    return sorted(req for req, ts in token_times(stream).items() if ts[0] <= t < ts[-1])


def percentile(xs: Iterable[float], q: float) -> float | None:
    """q in [0, 100], linear interpolation between order statistics; None for no data."""
    s = sorted(xs)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo, frac = int(math.floor(pos)), pos - math.floor(pos)
    return s[lo] if frac == 0 else s[lo] + (s[lo + 1] - s[lo]) * frac


def cdf(xs: Iterable[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their cumulative fractions, for plotting."""
    s = sorted(xs)
    return s, [(i + 1) / len(s) for i in range(len(s))]


def latency_summary(arrival: dict[str, float], times: dict[str, list[float]]) -> dict:
    """TTFT, TBT and throughput from arrival times and per-request token times alone.

    The part of summarize() that needs no step records, so baselines that only
    give token timestamps (transformers generate) are measured the same way.
    """
    ttft = [ts[0] - arrival[r] for r, ts in times.items() if ts and r in arrival]
    tbt = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    n_out = sum(len(ts) for ts in times.values())
    last_t = max((ts[-1] for ts in times.values() if ts), default=None)
    start = min(arrival.values(), default=None)
    duration = last_t - start if last_t is not None and start is not None else None
    return {
        "requests": sum(1 for ts in times.values() if ts),
        "output_tokens": n_out,
        "duration_s": duration,
        "output_tokens_per_s": n_out / duration if duration else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "ttft_max_s": max(ttft, default=None),
        "tbt_p50_s": percentile(tbt, 50), "tbt_p99_s": percentile(tbt, 99), "tbt_max_s": max(tbt, default=None),
    }


def summarize(stream: Iterable[dict], reqs: Iterable[str] | None = None) -> dict:
    """The headline numbers of a run. Latencies cover `reqs` (default: all); throughput always covers all."""
    stream = list(stream)
    recs = steps(stream)
    times, arr = token_times(stream), arrivals(stream)
    if not arr and recs:            # a stream without request events: time runs from its first step
        arr = {"": recs[0]["t_start"]}
    out = latency_summary(arr, times)
    keep = set(reqs) if reqs is not None else None
    if keep is not None:
        mine = latency_summary({r: t for r, t in arr.items() if r in keep}, {r: t for r, t in times.items() if r in keep})
        out.update({k: v for k, v in mine.items() if k.startswith(("ttft", "tbt")) or k == "requests"})
    stall = [s for req, st in stalls(stream).items() if keep is None or req in keep for _, s in st]
    fills = [f for _, _, f in budget_fill(stream)]
    waiting_slots = [r["max_num_seqs"] - len(r["items"]) for r in recs if r.get("waiting", 0) > 0]
    out.update({
        "stall_count": len(stall), "stall_max_s": max(stall, default=0.0) if out["tbt_max_s"] is not None else None,
        "num_steps": len(recs),
        "num_preemptions": sum(len(r.get("preempted", [])) for r in recs),
        "budget_fill_mean": sum(fills) / len(fills) if fills else None,
        "budget_fill_max": max(fills, default=None),
        # slots left empty in steps where a request was waiting: static batching's waste
        "idle_slots_while_waiting": sum(waiting_slots),
        "cached_prompt_tokens": sum(i.get("cached", 0) for r in recs for i in r["items"]),
    })
    return out


def focus_summary(stream: Iterable[dict], focus_req: str) -> dict:
    """Latencies of the requests that were decoding when `focus_req` arrived (the ones it could stall)."""
    stream = list(stream)
    t = arrivals(stream).get(focus_req)
    victims = decoding_at(stream, t) if t is not None else []
    s = summarize(stream, reqs=victims)
    names = labels(stream)
    return {"focus": focus_req, "victims": victims, "victim_labels": [names.get(v, v) for v in victims], "tbt_p50_s": s["tbt_p50_s"], "tbt_p99_s": s["tbt_p99_s"],
            "tbt_max_s": s["tbt_max_s"], "stall_count": s["stall_count"], "stall_max_s": s["stall_max_s"],
            "focus_ttft_s": ttfts(stream).get(focus_req)}
