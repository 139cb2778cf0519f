"""Why, not only what: step cost and stall causes, computed from the record stream alone. Pure Python.

The one definition of the numbers the page's "why" views show (static/analysis.js
computes the same numbers the same way; tests/test_why_views.py replays a recorded
trace into both and compares). Nothing in the engine's own path uses it: it reads
the records the engine publishes, so it lives with the app that shows them.

  step cost    a least-squares fit, per `device` (device/dtype), of each computed
               step's wall time (t_end - t_start) against its shape:
                   time ~ a + b * tokens + c * context
               tokens = the step's num_tokens; context = the tokens its attention
               read, sum over items of (start + tokens). Failed and empty steps are
               left out. When context adds nothing the normal equations cannot
               separate (a pivot under 1e-9 of its column's scale), the fit drops
               c, then b. R2 = 1 - residual / total sum of squares (None when every
               time is equal, up to rounding).
  regime       `flat` when a full budget's tokens cost less than the fixed part of
               a step (b * budget < a: extra decodes ride almost free, a GPU), else
               `proportional` (a step costs in proportion to its tokens, a CPU).
  advice       the largest token budget whose predicted step time, at the typical
               (median) context of the fitted steps, meets a target time between
               tokens: floor((target - a - c * context) / b).
  gap parts    for every gap between two tokens of one request that spans at least
               one step (a step ran that gave the request no token), one part per
               such step: its cause and its seconds (that step's wall time). Causes:
               the step's `stall_causes` entry (prefill, static_batch, budget,
               no_slot, kv_full, policy), `preempted` from the step that preempted the request until
               its next token, `unknown` for a stalled request without a recorded
               cause (traces from before causes were recorded).
  cause time   per stretch of settings (app/readers/metrics.py): summed part seconds by
               cause, for parts whose step lies in the stretch. Summed over replies:
               two replies left out of one step count its time twice (waiting felt).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from app.readers.metrics import events, produces_token, setting, steps

CAUSES = ("prefill", "static_batch", "budget", "no_slot", "kv_full", "policy", "preempted", "unknown")
PIVOT_EPS = 1e-9


# ---- step cost ----
class CostPoint(NamedTuple):
    step: int
    seconds: float
    tokens: int
    context: int
    kind: str           # decode (decode items only), prefill (prefill items only) or mixed


class CostFit(NamedTuple):
    device: str
    a: float            # seconds per step, whatever its size
    b: float            # seconds per token computed
    c: float            # seconds per context token read
    r2: float | None
    n: int              # steps fitted
    terms: int          # 3, or fewer when the data could not separate them


def context_read(rec: dict) -> int:
    """Keys the step's attention read: each item attends to its cached context and its own tokens."""
    return sum(it["start"] + it["tokens"] for it in rec["items"])


def step_kind(rec: dict) -> str:
    kinds = {it["kind"] for it in rec["items"]}
    return "mixed" if len(kinds) > 1 else kinds.pop()


def cost_points(stream: Iterable[dict], device: str | None = None, last: int | None = None) -> list[CostPoint]:
    """The computed steps of one device (default: every step), oldest first; `last`: only the newest N."""
    pts = [CostPoint(r["step"], r["t_end"] - r["t_start"], r["num_tokens"], context_read(r), step_kind(r))
           for r in steps(stream)
           if r["items"] and not r.get("failed") and (device is None or r.get("device", "") == device)]
    return pts[-last:] if last else pts


def devices(stream: Iterable[dict]) -> list[str]:
    """The device/dtype names in the stream, in order of first appearance ("" for records without one)."""
    return list(dict.fromkeys(r.get("device", "") for r in steps(stream) if r["items"]))


def solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when a pivot is under PIVOT_EPS of its column's scale."""
    n = len(v)
    m = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = [max(abs(m[r][c]) for r in range(n)) or 1.0 for c in range(n)]
    for col in range(n):
        p = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[p][col]) <= PIVOT_EPS * scale[col]:
            return None
        m[col], m[p] = m[p], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def fit_cost(points: list[CostPoint], device: str = "") -> CostFit | None:
    """Least squares time ~ a + b*tokens + c*context (fewer terms when the points cannot tell them apart)."""
    if not points:
        return None
    ys = [p.seconds for p in points]
    # every term first; then without context, then without tokens (a stream whose steps all have one
    # token count can still tell context apart), then the mean
    for cols in ((0, 1, 2), (0, 1), (0, 2), (0,)):
        if len(points) < len(cols):
            continue
        xs = [[(1.0, float(p.tokens), float(p.context))[i] for i in cols] for p in points]
        n = len(cols)
        ata = [[sum(x[i] * x[j] for x in xs) for j in range(n)] for i in range(n)]
        aty = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(n)]
        sol = solve(ata, aty)
        if sol is not None:
            break
    coef = [0.0, 0.0, 0.0]
    for i, v in zip(cols, sol):
        coef[i] = v
    terms = len(cols)
    mean = sum(ys) / len(ys)
    ss_tot = sum((y - mean) ** 2 for y in ys)
    ss_res = sum((y - predict_parts(coef, p.tokens, p.context)) ** 2 for p, y in zip(points, ys))
    # equal times (up to rounding) leave nothing to explain: no R2
    r2 = 1 - ss_res / ss_tot if ss_tot > 1e-20 * sum(y * y for y in ys) else None
    return CostFit(device, coef[0], coef[1], coef[2], r2, len(points), terms)


def predict_parts(coef: list[float], tokens: float, context: float) -> float:
    return coef[0] + coef[1] * tokens + coef[2] * context


def predict(fit: CostFit, tokens: float, context: float) -> float:
    return fit.a + fit.b * tokens + fit.c * context


def fit_stream(stream: Iterable[dict], last: int | None = None) -> list[CostFit]:
    """One fit per device/dtype in the stream."""
    stream = list(stream)
    out = [fit_cost(cost_points(stream, d, last), d) for d in devices(stream)]
    return [f for f in out if f is not None]


def median(xs: list[float]) -> float | None:
    s = sorted(xs)
    if not s:
        return None
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def regime(fit: CostFit, budget: int) -> str:
    return "flat" if fit.b * budget < fit.a else "proportional"


def advise_budget(fit: CostFit, target_s: float, context: float) -> int | None:
    """Largest budget whose predicted step time at `context` meets target_s; None when no budget does,
    or when the fit gives tokens no cost (b <= 0: the fit sets no limit)."""
    if not target_s > 0:
        raise ValueError(f"target time between tokens must be a positive number of seconds, got {target_s!r}")
    if fit.b <= 0:
        return None
    budget = int((target_s - fit.a - fit.c * context) // fit.b)
    return budget if budget >= 1 else None


# ---- stall causes ----
class GapPart(NamedTuple):
    step: int
    seconds: float
    cause: str
    by: str | None          # prefill / static_batch: the request whose prompt took the step
    by_tokens: int | None


class Gap(NamedTuple):
    req: str
    after: int              # step of the token before the gap
    step: int               # step of the token that ended it
    seconds: float          # the TBT
    parts: tuple[GapPart, ...]

    @property
    def cause(self) -> str:
        """The cause that took the most seconds (ties: the earliest)."""
        total: dict[str, float] = {}
        for p in self.parts:
            total[p.cause] = total.get(p.cause, 0.0) + p.seconds
        return max(total, key=total.get)


def gap_causes(stream: Iterable[dict]) -> list[Gap]:
    """Every gap of a reply that spans at least one step, with the cause of each step in it, in step order."""
    out: list[Gap] = []
    last: dict[str, tuple[int, float]] = {}     # req -> (step, t_end) of its latest token
    parts: dict[str, list[GapPart]] = {}        # req -> parts since that token
    out_of_cache: set[str] = set()              # preempted since their latest token
    for rec in steps(stream):
        dur, step = rec["t_end"] - rec["t_start"], rec["step"]
        got = [it["req"] for it in rec["items"] if produces_token(it)]     # in item order
        causes = {c["req"]: c for c in rec.get("stall_causes", ())}
        out_of_cache.update(r for r in rec.get("preempted", ()) if r in last)
        for req in last:
            if req in got:
                continue
            if req in out_of_cache:
                parts[req].append(GapPart(step, dur, "preempted", None, None))
            elif req in rec.get("stalled", ()):
                c = causes.get(req, {})
                parts[req].append(GapPart(step, dur, c.get("cause", "unknown"), c.get("by"), c.get("by_tokens")))
        for req in got:
            if req in last and parts[req]:
                out.append(Gap(req, last[req][0], step, rec["t_end"] - last[req][1], tuple(parts[req])))
            last[req], parts[req] = (step, rec["t_end"]), []
            out_of_cache.discard(req)
        for req in rec.get("finished", ()):
            last.pop(req, None)
            parts.pop(req, None)
    return out


def cause_time(stream: Iterable[dict]) -> list[dict[str, float]]:
    """Per stretch of settings (as metrics.stretches), seconds of gap parts by cause
    (every cause present, 0.0 if none)."""
    stream = list(stream)
    recs = steps(stream)
    bounds: list[tuple[int, int]] = []
    for i, rec in enumerate(recs):
        if i and setting(recs[i - 1]) == setting(rec):
            bounds[-1] = (bounds[-1][0], rec["step"])
        else:
            bounds.append((rec["step"], rec["step"]))
    out = [{c: 0.0 for c in CAUSES} for _ in bounds]
    for gap in gap_causes(stream):
        for p in gap.parts:
            k = next(i for i, (s0, s1) in enumerate(bounds) if s0 <= p.step <= s1)
            out[k][p.cause] += p.seconds
    return out


# ---- the KV cache map ----
def kv_blocks(stream: Iterable[dict], upto: int | None = None,
              worker: str | None = None) -> dict[int, tuple[tuple[str, ...], bool]]:
    """block id -> (holders, sorted; cached) after step `upto` (default: the last), for every block held or cached.

    Rebuilt from each step's `kv_ops`, starting over from a step's `kv_map` where one is sent (a stream that
    begins mid-run is exact from its first map on). `worker` (disaggregated): that worker's cache, from its
    own steps and the `kv_ops` of each hand-over it sent (its frees, at the export's start, t - seconds):
    they fall between its steps, and after the last hand-over no step of its reports them. Without
    `worker`: the steps of the single engine.
    """
    stream = list(stream)
    everyone = [r for r in steps(stream) if upto is None or r["step"] <= upto]
    until = everyone[-1]["t_end"] if everyone else float("-inf")
    handovers = sorted(((e["t"] - e["seconds"], e["kv_ops"]) for e in events(stream, "kv_transfer")
                        if e.get("from_worker") == worker and e.get("kv_ops")), key=lambda h: h[0])
    state: dict[int, tuple[set[str], bool]] = {}

    def apply(ops):
        for op in ops:
            b, req = op["block"], op["req"]
            if op["op"] == "alloc":
                state[b] = ({req}, False)
            elif op["op"] == "share":
                state.setdefault(b, (set(), True))[0].add(req)
            elif op["op"] == "free":
                state.get(b, (set(), False))[0].discard(req)
            elif op["op"] == "commit":
                state[b] = (state.get(b, ({req}, False))[0], True)

    for rec in (r for r in everyone if r.get("worker") == worker):
        while handovers and handovers[0][0] < rec["t_start"]:
            apply(handovers.pop(0)[1])
        apply(rec.get("kv_ops", ()))
        if "kv_map" in rec:
            state = {e["block"]: (set(e["holders"]), e["cached"]) for e in rec["kv_map"]}
    for t0, ops in handovers:
        if t0 <= until:
            apply(ops)
    return {b: (tuple(sorted(h)), c) for b, (h, c) in sorted(state.items()) if h or c}
