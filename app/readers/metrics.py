"""Serving metrics, computed from the record stream alone. Pure Python: no torch.

The one definition of every number a student sees: the page (static/metrics.js
computes the same numbers the same way, tested in a browser), the reports and
benchmarks in demos/, and scripts/gpu_check.py all use these. It lives in
app/ with the other readers of the record stream (analysis, traces, scenario
replay), not in the engine, which never reads its own records back; demos/ and
scripts/ import it from here. Importing it loads no torch and no web stack.

Input is a *stream*: the objects the engine publishes (step records and request
events, in any order; other types are ignored). A live subscription, a saved
trace and a GPU run give the same numbers.

  token time   t_end of a step in which one of the request's items produced a
               token: a decode item, or a prefill item with completes_prompt.
               A decode verifying drafts (speculative decoding) produces
               1 + `accepted` tokens at once: the first has the gap since the
               reply's previous token as its TBT, the others a TBT of 0.
  acceptance rate   speculative decoding: accepted / drafted tokens, summed over
               the decode items that verified drafts (None when none did).
  TTFT         first token time - arrival time (the request's "arrived" event).
  TBT          gap between consecutive tokens of one request (vLLM's ITL).
  longest gap  the largest TBT.
  phases       of one request, as vLLM's metrics split it (scheduled = t_start of
               the first step that ran any of its tokens; tokens = its token times):
               queue = scheduled - arrival, prefill = first token - scheduled,
               decode = last token - first token, inference = last token -
               scheduled, TPOT = decode / (tokens - 1) (None for one token).
               queue + prefill is the TTFT.
  stall        a TBT during which at least one step listed the request in its
               `stalled` field: the request was running with a reply under way
               and the step left it out. A preempted request is not running
               (its KV is freed and it waits to be recomputed), so the wait after
               a preemption is not a stall: it is counted in `num_preemptions`,
               and its gap is still a TBT (often the longest gap). Records that
               are missing from a stream (a viewer that fell behind) never make
               a stall either: only a step that says so does.
  percentile   linear interpolation between order statistics (numpy's default):
               the value at position (n - 1) * q / 100 of the sorted sample.
               Empty samples give None.
  stretch      a maximal run of consecutive step records (in step order) under
               one setting (policy, token budget, max sequences, speculative
               tokens, prefix caching on or off, the KV cap, the chunk cap); the page's metrics
               table has one column per stretch.
  mean TBT     the mean of the TBTs: per reply, (last - first token) / (tokens - 1),
               weighted by tokens; what speculative decoding shortens.
  prefix hit rate   of the prompts read in a stretch, the share of their tokens
               the prefix cache served: summed `cached` / summed `prompt_len` over
               the prefill items that begin a prompt's read (start == cached, or 0);
               a recompute after preemption is a read of its own. None with no read.
  preemptions  the requests a stretch's steps preempted (its `preempted` lists).
  output tokens/s   all output tokens / (last token time - first arrival).
  budget fill  step num_tokens / token_budget (above 1 when a whole prompt
               longer than the budget runs in one step).
  goodput      DistServe's: the share of requests that met both their SLOs, a TTFT
               limit and a time-between-tokens limit (their longest TBT, so one
               freeze fails the request). `slo_attainment` takes each request's two
               limits in seconds and, optionally, the times they were due to arrive
               (a request due mid-step is taken in after the step; its TTFT counts
               from when it was due). A request that never produced a token misses.
  KV transfer  disaggregated: a request's KV handed from the prefill worker to
               the decode worker (its `kv_transfer` event): seconds from the
               export's start to the import's end, and bytes. A stretch's
               transfers are those whose import ended (event `t`) between the
               stretch's first t_start and its last t_end, and after the t_end
               of the step before it (a transfer on the boundary of two
               stretches counts once, in the earlier).

    from app.readers import metrics
    metrics.summarize(stream)                    # the numbers of docs/results.md
    metrics.summarize(stream, reqs={"r0", "r1"}) # latencies of some requests only
    metrics.stretches(stream)                    # the page's metrics table, one dict per column
    metrics.tbts(stream)["r0"]                   # [s, s, ...]
    metrics.user_rows(stream)                    # one row per label: the what-if table
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple


# ---- reading the stream: steps, events, and when each token came ----
class Token(NamedTuple):
    step: int               # the step that produced it
    t: float                # that step's t_end
    gap: float | None       # TBT: seconds since the request's previous token (None for the first)
    stalled: bool           # a step between the previous token and this one left the request out


def percentile(xs: Iterable[float], q: float) -> float | None:
    """q in [0, 100]; linear interpolation between order statistics; None for no data."""
    s = sorted(xs)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    return s[lo] if lo == pos else s[lo] + (s[lo + 1] - s[lo]) * (pos - lo)


def steps(stream: Iterable[dict]) -> list[dict]:
    """The step records, in step order."""
    return sorted((r for r in stream if r.get("type") == "step"), key=lambda r: r["step"])


def events(stream: Iterable[dict], event: str | None = None) -> list[dict]:
    """Request events (of one kind when `event` is given), in time order."""
    return sorted((r for r in stream if r.get("type") == "request" and (event is None or r["event"] == event)),
                  key=lambda r: r["t"])


def produces_token(item: dict) -> bool:
    return item["kind"] == "decode" or bool(item.get("completes_prompt"))


def tokens_given(item: dict) -> int:
    """Output tokens a step's item gave its reply: a verifying decode 1 + its accepted drafts."""
    return 1 + (item.get("accepted") or 0) if produces_token(item) else 0


def acceptance_rate(drafted: int, accepted: int) -> float | None:
    return accepted / drafted if drafted else None


def drafts(recs: Iterable[dict]) -> tuple[int, int]:
    """(drafted, accepted) tokens over the decode items of these step records."""
    items = [it for r in recs for it in r["items"] if it.get("drafted")]
    return sum(it["drafted"] for it in items), sum(it.get("accepted") or 0 for it in items)


class TokenClock:
    """The tokens of each step as it comes (steps in step order): the one place a TBT and a stall are made."""

    def __init__(self):
        self.last: dict[str, float] = {}    # req -> time of its latest token
        self.left_out: set[str] = set()     # requests some step has left out since their last token

    def step(self, rec: dict) -> list[tuple[str, Token]]:
        out = []
        for item in rec["items"]:
            if produces_token(item):
                req, prev = item["req"], self.last.get(item["req"])
                gap = rec["t_end"] - prev if prev is not None else None
                out.append((req, Token(rec["step"], rec["t_end"], gap, gap is not None and req in self.left_out)))
                out.extend((req, Token(rec["step"], rec["t_end"], 0.0, False)) for _ in range(tokens_given(item) - 1))
                self.last[req] = rec["t_end"]
                self.left_out.discard(req)
        self.left_out.update(rec.get("stalled", ()))
        return out

    def forget(self, req: str):
        """req has ended: a long-running reader lets go of it."""
        self.last.pop(req, None)
        self.left_out.discard(req)


def tokens(stream: Iterable[dict]) -> dict[str, list[Token]]:
    """req -> its output tokens in order, each with its TBT and whether that TBT was a stall."""
    out: dict[str, list[Token]] = {}
    clock = TokenClock()
    for rec in steps(stream):
        for req, tk in clock.step(rec):
            out.setdefault(req, []).append(tk)
    return out


def token_times(stream: Iterable[dict]) -> dict[str, list[float]]:
    return {req: [tk.t for tk in tks] for req, tks in tokens(stream).items()}


def tbt_by_streams(stream: Iterable[dict], reqs: Iterable[str] | None = None) -> dict[int, float]:
    """Mean TBT of the tokens of decode-only steps, by how many replies (streams) such a step decoded:
    {1: s, 16: s, ...}. reqs: count only their tokens (and steps that ran any of them)."""
    keep = set(reqs) if reqs is not None else None
    gaps_at: dict[int, list[float]] = {}
    clock = TokenClock()
    for rec in steps(stream):
        new = clock.step(rec)
        items = rec["items"]
        if not items or any(it["kind"] != "decode" for it in items):
            continue
        for req, tk in new:
            if tk.gap is not None and (keep is None or req in keep):
                gaps_at.setdefault(len(items), []).append(tk.gap)
    return {n: sum(g) / len(g) for n, g in sorted(gaps_at.items())}


# ---- per request: arrival, TTFT, phases, TBTs and stalls ----
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


class Phases(NamedTuple):
    queue: float
    prefill: float
    decode: float
    inference: float
    tpot: float | None


def phases(arrival: float, scheduled: float, times: list[float]) -> Phases:
    """One request's phases (see the definitions above); times: its token times, at least one."""
    decode = times[-1] - times[0]
    return Phases(scheduled - arrival, times[0] - scheduled, decode, times[-1] - scheduled,
                  decode / (len(times) - 1) if len(times) > 1 else None)


def gaps(times: list[float]) -> list[float]:
    """TBTs of one request from its token times."""
    return [b - a for a, b in zip(times, times[1:])]


def tbts(stream: Iterable[dict]) -> dict[str, list[float]]:
    """req -> gaps between its consecutive tokens."""
    return {req: gaps(ts) for req, ts in token_times(stream).items()}


def stalls(stream: Iterable[dict]) -> dict[str, list[Token]]:
    """req -> the tokens that ended a stall (token.gap is the stall's length)."""
    return {req: [tk for tk in tks if tk.stalled] for req, tks in tokens(stream).items()}


def tbt_series(stream: Iterable[dict], reqs: Iterable[str] | None = None) -> list[tuple[float, float, str]]:
    """(token time, TBT, req) for every token after the first, sorted by time: TBT over time."""
    keep = set(reqs) if reqs is not None else None
    rows = [(tk.t, tk.gap, req) for req, tks in tokens(stream).items()
            if keep is None or req in keep for tk in tks if tk.gap is not None]
    return sorted(rows)


def budget_fill(stream: Iterable[dict]) -> list[tuple[int, float, float]]:
    """(step, t_end, num_tokens / token_budget) per step."""
    return [(r["step"], r["t_end"], r["num_tokens"] / r["token_budget"]) for r in steps(stream)]


def decoding_at(stream: Iterable[dict], t: float) -> list[str]:
    """Requests with a reply under way at time t: first token at or before t, another token after it."""
    return sorted(req for req, ts in token_times(stream).items() if ts[0] <= t < ts[-1])


# ---- summaries: a run's numbers, one request's, one row per user ----
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
    tbt = [g for ts in times.values() for g in gaps(ts)]
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
        "tbt_mean_s": sum(tbt) / len(tbt) if tbt else None,
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
        mine = latency_summary({r: t for r, t in arr.items() if r in keep},
                               {r: t for r, t in times.items() if r in keep})
        out.update({k: v for k, v in mine.items() if k.startswith(("ttft", "tbt")) or k == "requests"})
    drafted, accepted = drafts(recs)
    stall = [tk.gap for req, st in stalls(stream).items() if keep is None or req in keep for tk in st]
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
        "draft_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": acceptance_rate(drafted, accepted),
    })
    out.update({"kv_" + k: v for k, v in transfer_summary(events(stream, "kv_transfer")).items()})
    return out


def transfer_summary(transfers: list[dict]) -> dict:
    """Count, p50/p99 seconds and summed bytes of some kv_transfer events."""
    secs = [e["seconds"] for e in transfers]
    return {"transfers": len(transfers), "transfer_p50_s": percentile(secs, 50),
            "transfer_p99_s": percentile(secs, 99), "transfer_bytes": sum(e["bytes"] for e in transfers)}


def focus_summary(stream: Iterable[dict], focus_req: str) -> dict:
    """Latencies of the requests that were decoding when `focus_req` arrived (the ones it could stall)."""
    stream = list(stream)
    t = arrivals(stream).get(focus_req)
    victims = decoding_at(stream, t) if t is not None else []
    s = summarize(stream, reqs=victims)
    names = labels(stream)
    return {"focus": focus_req, "victims": victims, "victim_labels": [names.get(v, v) for v in victims],
            "tbt_p50_s": s["tbt_p50_s"], "tbt_p99_s": s["tbt_p99_s"],
            "tbt_max_s": s["tbt_max_s"], "stall_count": s["stall_count"], "stall_max_s": s["stall_max_s"],
            "focus_ttft_s": ttfts(stream).get(focus_req)}


def user_rows(stream: Iterable[dict], reqs: Iterable[str] | None = None) -> list[dict]:
    """One row per label (a chat panel's user, an OpenAI `user`), in order of first arrival: the
    what-if table. A label with several requests gets its worst TTFT, the p99 of all its TBTs and
    its longest stall (0.0 with none; None when it never had a second token)."""
    stream = list(stream)
    keep = set(reqs) if reqs is not None else None
    names, arr, toks = labels(stream), arrivals(stream), tokens(stream)
    order = sorted((r for r in names if keep is None or r in keep), key=lambda r: arr.get(r, math.inf))
    by_label: dict[str, list[str]] = {}
    for req in order:
        by_label.setdefault(names[req], []).append(req)
    rows = []
    for label, rs in by_label.items():
        mine = [tk for r in rs for tk in toks.get(r, [])]
        tbt = [tk.gap for tk in mine if tk.gap is not None]
        ttft = [toks[r][0].t - arr[r] for r in rs if toks.get(r) and r in arr]
        rows.append({"label": label, "requests": len(rs), "ttft_s": max(ttft, default=None),
                     "tbt_p99_s": percentile(tbt, 99),
                     "longest_stall_s": max((tk.gap for tk in mine if tk.stalled), default=0.0) if tbt else None,
                     "output_tokens": len(mine)})
    return rows


# ---- per-setting stretches: the page's metrics table ----
def setting(rec: dict) -> tuple:
    return (rec["policy"], rec["token_budget"], rec["max_num_seqs"], rec.get("speculative"),
            rec.get("prefix_caching", True), rec["kv"].get("limit"), rec.get("max_prefill_chunk"))


def begins_prompt(item: dict) -> bool:
    """A prefill item that starts a prompt's read (the first chunk, after any cached prefix)."""
    return item["kind"] == "prefill" and item["start"] == (item.get("cached") or 0)


def stretches(stream: Iterable[dict]) -> list[dict]:
    """One dict per stretch of steps under one setting, oldest first: what each column of the page shows.

    Within a stretch: TTFT of the requests whose first token falls in it; TBT and
    stall of the tokens produced in it (a gap may begin in the stretch before);
    output tokens/s = its tokens / (its last t_end - its first t_start); the
    highest KV use and waiting queue after any of its steps; busy = summed step times.
    """
    stream = list(stream)
    meter = StretchMeter()
    for e in events(stream):            # a stream at rest has every arrival and hand-over: first
        meter.observe(e)
    for rec in steps(stream):
        meter.observe(rec)
    return meter.stretches()


class StretchMeter:
    """stretches(), one record at a time, for a run that never ends (the server keeps one for late
    viewers, app/serving/broadcast.py). Feed step records in step order and request events as they come
    (an arrival before its request's first token). Keeps per stretch only what its numbers need:
    its TTFTs and TBTs, a few maxima and sums; a stretch is summarised again only when it has grown."""

    def __init__(self):
        self.clock = TokenClock()
        self.arrived: dict[str, float] = {}
        self.moved: list[dict] = []         # kv_transfer events
        self.runs: list[_Run] = []

    def observe(self, obj: dict):
        kind = obj.get("type")
        if kind == "request" and obj.get("event") == "arrived":
            self.arrived[obj["req"]] = obj["t"]
        elif kind == "request" and obj.get("event") == "kv_transfer":
            self.moved.append(obj)
        elif kind == "step":
            run = self.runs[-1] if self.runs else None
            if run is None or run.setting != setting(obj):
                run = _Run(obj, run.last["t_end"] if run else None)
                self.runs.append(run)
            run.add(obj, self.clock.step(obj), self.arrived)

    def stretches(self) -> list[dict]:
        return [run.summary(self.moved) for run in self.runs]


class _Run:
    """The accumulators of one stretch."""

    def __init__(self, first: dict, after: float | None):
        self.setting, self.first, self.last, self.after = setting(first), first, first, after
        self.num_steps = self.output_tokens = self.waiting_max = self.drafted = self.accepted = 0
        self.prompt_tokens = self.cached_tokens = self.preemptions = 0
        self.ttft: list[float] = []
        self.tbt: list[float] = []
        self.stall_max = self.kv_used_max = self.busy = 0.0
        self._summary: dict | None = None

    def add(self, rec: dict, new: list[tuple[str, Token]], arrived: dict[str, float]):
        self.last = rec
        self.num_steps += 1
        for req, tk in new:
            self.output_tokens += 1
            if tk.gap is None:
                if req in arrived:
                    self.ttft.append(tk.t - arrived[req])
            else:
                self.tbt.append(tk.gap)
                if tk.stalled:
                    self.stall_max = max(self.stall_max, tk.gap)
        for item in rec["items"]:
            if begins_prompt(item):
                self.prompt_tokens += item["prompt_len"]
                self.cached_tokens += item.get("cached") or 0
        self.preemptions += len(rec.get("preempted", ()))
        kv = rec["kv"]
        room = kv.get("limit") or kv["total"]          # under a KV cap, its share of the cap
        self.kv_used_max = max(self.kv_used_max, kv["used"] / room if room else 0.0)
        self.waiting_max = max(self.waiting_max, rec["waiting"])
        self.busy += rec["t_end"] - rec["t_start"]
        drafted, accepted = drafts([rec])
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted

    def summary(self, moved: list[dict]) -> dict:
        if self._summary is None or self._summary["num_steps"] != self.num_steps:     # grown since
            span = self.last["t_end"] - self.first["t_start"]
            policy, budget, max_seqs, speculative, caching, limit, chunk = self.setting
            self._summary = {
                "policy": policy, "token_budget": budget, "max_num_seqs": max_seqs, "speculative": speculative,
                "prefix_caching": caching, "max_kv_blocks": limit, "max_prefill_chunk": chunk,
                "first_step": self.first["step"], "last_step": self.last["step"], "num_steps": self.num_steps,
                "ttft_p50_s": percentile(self.ttft, 50), "ttft_p99_s": percentile(self.ttft, 99),
                "tbt_p50_s": percentile(self.tbt, 50), "tbt_p99_s": percentile(self.tbt, 99),
                "longest_gap_s": max(self.tbt, default=None),
                "tbt_mean_s": sum(self.tbt) / len(self.tbt) if self.tbt else None,
                "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": acceptance_rate(self.drafted, self.accepted),
                "stall_max_s": self.stall_max,
                "output_tokens": self.output_tokens,
                "output_tokens_per_s": self.output_tokens / span if span > 0 else None,
                "kv_used_max": self.kv_used_max, "waiting_max": self.waiting_max, "busy_s": self.busy,
                "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
                "preemptions": self.preemptions,
            }
        # hand-overs may be reported after the stretch has closed: counted afresh each time (few of them)
        t0, t1 = self.first["t_start"], self.last["t_end"]
        return {**self._summary, **transfer_summary(
            [e for e in moved if t0 <= e["t"] <= t1 and (self.after is None or e["t"] > self.after)])}


# ---- SLOs: goodput ----
def slo_attainment(stream: Iterable[dict], slos: dict[str, tuple[float, float]],
                   due: dict[str, float] | None = None) -> dict[str, dict]:
    """req -> {ttft_s, longest_tbt_s, ttft_ok, tbt_ok, ok} for each request of `slos` (req -> (TTFT limit,
    TBT limit) in seconds); TTFT from `due` where given, else from the arrived event."""
    stream = list(stream)
    arr, toks = arrivals(stream), tokens(stream)
    out = {}
    for req, (ttft_limit, tbt_limit) in slos.items():
        mine, start = toks.get(req, []), (due or {}).get(req, arr.get(req))
        ttft = mine[0].t - start if mine and start is not None else None
        longest = max((tk.gap for tk in mine if tk.gap is not None), default=0.0) if mine else None
        ttft_ok = ttft is not None and ttft <= ttft_limit
        tbt_ok = longest is not None and longest <= tbt_limit
        out[req] = {"ttft_s": ttft, "longest_tbt_s": longest, "ttft_ok": ttft_ok, "tbt_ok": tbt_ok,
                    "ok": ttft_ok and tbt_ok}
    return out


def goodput(attainment: dict[str, dict]) -> float | None:
    """The share of requests that met both SLOs (None for no requests)."""
    return sum(a["ok"] for a in attainment.values()) / len(attainment) if attainment else None
