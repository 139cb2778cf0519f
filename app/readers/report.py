"""The comparison report: one self-contained HTML file (plotly embedded, opens offline).

    from app.readers.report import write_report
    write_report("out/report.html", scenario, runs, summaries)

runs: {name: anything with .stream and .meta} (demos/compare/runner.py's Run, app/replay/whatif.py's
Replayed); summaries: {name: metrics dict}, as demos.compare and the what-if replay build them. Sections:
metrics table, one Gantt chart per policy (which request was in which step, prefill vs decode, stalls in red),
TBT over time, TTFT and TBT CDFs, budget fill per step.
"""
from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from app.readers import metrics

COLORS = {"static": "#7f7f7f", "continuous": "#d62728", "chunked": "#1f77b4"}
KIND_COLORS = {"prefill": "#ff7f0e", "decode": "#2ca02c", "stall": "rgba(214,39,40,0.35)"}
_LAYOUT = dict(template="plotly_white", height=360, margin=dict(l=70, r=20, t=50, b=50))


def _color(policy: str, i: int) -> str:
    return COLORS.get(policy, ["#9467bd", "#8c564b", "#e377c2", "#17becf"][i % 4])


def _t0(stream: list[dict]) -> float:
    times = list(metrics.arrivals(stream).values()) + [r["t_start"] for r in metrics.steps(stream)[:1]]
    return min(times) if times else 0.0


def segments(stream: list[dict]) -> list[dict]:
    """Gantt bars: runs of consecutive steps in which one request had items of one kind, plus its stalls."""
    recs = metrics.steps(stream)
    out, open_seg = [], {}
    for rec in recs:
        for item in rec["items"]:
            key, seg = item["req"], open_seg.get(item["req"])
            if seg and seg["kind"] == item["kind"] and seg["last_step"] == rec["step"] - 1:
                seg["end"], seg["last_step"] = rec["t_end"], rec["step"]
                seg["tokens"] += item["tokens"]
            else:
                if seg:
                    out.append(seg)
                open_seg[key] = {"req": key, "kind": item["kind"], "start": rec["t_start"], "end": rec["t_end"],
                                 "last_step": rec["step"], "tokens": item["tokens"]}
    out.extend(open_seg.values())
    by_step = {r["step"]: r for r in recs}
    for req, st in metrics.stalls(stream).items():
        for tk in st:       # from the previous token to the start of the step that ended the stall
            out.append({"req": req, "kind": "stall", "start": tk.t - tk.gap, "end": by_step[tk.step]["t_start"],
                        "tokens": 0})
    return out


def gantt_figure(stream: list[dict], title: str) -> go.Figure:
    names = metrics.labels(stream)
    t0 = _t0(stream)
    order = list(dict.fromkeys(sorted(metrics.arrivals(stream), key=metrics.arrivals(stream).get)))
    ylab = {req: f"{names.get(req, req)} ({req})" for req in order}
    fig = go.Figure()
    segs = segments(stream)
    for kind in ("prefill", "decode", "stall"):
        ss = [s for s in segs if s["kind"] == kind and s["req"] in ylab]
        if not ss:
            continue
        fig.add_bar(name="stalled (left out)" if kind == "stall" else kind, orientation="h",
                    y=[ylab[s["req"]] for s in ss], base=[s["start"] - t0 for s in ss],
                    x=[max(s["end"] - s["start"], 1e-4) for s in ss], marker_color=KIND_COLORS[kind],
                    customdata=[s["tokens"] for s in ss],
                    hovertemplate="%{y}<br>%{base:.3f}s +%{x:.3f}s<br>tokens %{customdata}<extra>" + kind + "</extra>")
    arr = metrics.arrivals(stream)
    fig.add_scatter(name="arrival", mode="markers", x=[arr[r] - t0 for r in order], y=[ylab[r] for r in order],
                    marker=dict(symbol="triangle-right", size=10, color="black"))
    fig.update_layout(**_LAYOUT, title=title, barmode="overlay", xaxis_title="seconds from first arrival")
    fig.update_layout(height=max(220, 40 + 28 * len(order)))
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=[ylab[r] for r in order])
    return fig


def tbt_figure(streams: dict[str, list[dict]]) -> go.Figure:
    fig = go.Figure()
    for i, (policy, stream) in enumerate(streams.items()):
        t0 = _t0(stream)
        rows = metrics.tbt_series(stream)
        names = metrics.labels(stream)
        fig.add_scatter(name=policy, mode="markers", x=[t - t0 for t, _, _ in rows], y=[g * 1e3 for _, g, _ in rows],
                        text=[names.get(r, r) for _, _, r in rows], marker=dict(size=5, color=_color(policy, i)),
                        hovertemplate="%{text}: %{y:.1f} ms at %{x:.2f}s<extra>" + policy + "</extra>")
    fig.update_layout(**_LAYOUT, title="Time between tokens, every request", xaxis_title="seconds from first arrival",
                      yaxis_title="TBT (ms, log)", yaxis_type="log")
    return fig


def cdf_figure(values: dict[str, list[float]], title: str, axis: str) -> go.Figure:
    fig = go.Figure()
    for i, (policy, xs) in enumerate(values.items()):
        x, y = metrics.cdf([v * 1e3 for v in xs])
        fig.add_scatter(name=policy, x=x, y=y, mode="lines", line_shape="hv", line_color=_color(policy, i))
    fig.update_layout(**_LAYOUT, title=title, xaxis_title=axis, yaxis_title="fraction", xaxis_type="log")
    return fig


def fill_figure(streams: dict[str, list[dict]]) -> go.Figure:
    fig = go.Figure()
    for i, (policy, stream) in enumerate(streams.items()):
        rows = metrics.budget_fill(stream)
        s0 = rows[0][0] if rows else 0
        fig.add_scatter(name=policy, x=[s - s0 for s, _, _ in rows], y=[f for _, _, f in rows], mode="lines",
                        line_color=_color(policy, i), line_shape="hv")
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="token budget")
    fig.update_layout(**_LAYOUT, title="Budget fill per step (tokens in the step / token budget)",
                      xaxis_title="step", yaxis_title="fill")
    return fig


# ---- the page ----
TABLE_ROWS = [("output_tokens_per_s", "output tokens/s", 1), ("ttft_p50_s", "TTFT p50 (ms)", 1e3),
              ("ttft_p99_s", "TTFT p99 (ms)", 1e3), ("tbt_p50_s", "TBT p50 (ms)", 1e3),
              ("tbt_p99_s", "TBT p99 (ms)", 1e3), ("tbt_max_s", "TBT max (ms)", 1e3),
              ("stall_count", "stalls", None), ("stall_max_s", "longest stall (ms)", 1e3),
              ("num_steps", "steps", None), ("num_preemptions", "preemptions", None),
              ("budget_fill_mean", "budget fill, mean (%)", 100),
              ("idle_slots_while_waiting", "idle slots while waiting", None),
              ("cached_prompt_tokens", "prompt tokens from prefix cache", None), ("duration_s", "duration (s)", 1)]
FOCUS_ROWS = [("tbt_p50_s", "their TBT p50 (ms)", 1e3), ("tbt_p99_s", "their TBT p99 (ms)", 1e3),
              ("tbt_max_s", "their longest gap (ms)", 1e3), ("stall_max_s", "their longest stall (ms)", 1e3),
              ("focus_ttft_s", "TTFT of the newcomer (ms)", 1e3)]


def fmt(v, scale) -> str:
    if v is None:
        return "–"
    if scale is None:
        return str(v)
    x = v * scale
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) < 1 else f"{x:.1f}"


def metrics_table(summaries: dict[str, dict], rows=TABLE_ROWS, key: str | None = None) -> str:
    head = "".join(f"<th>{html.escape(p)}</th>" for p in summaries)
    body = ""
    for field, name, scale in rows:
        cells = "".join(f"<td>{fmt((s.get(key) if key else s).get(field), scale)}</td>" for s in summaries.values())
        body += f"<tr><th>{html.escape(name)}</th>{cells}</tr>"
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}
th:first-child{text-align:left}h2{margin-top:2em}.meta{color:#666;font-size:90%}"""


def write_report(path: str | Path, scenario, runs: dict, summaries: dict[str, dict], repeats: int = 1) -> Path:
    streams = {p: r.stream for p, r in runs.items()}
    figs = [gantt_figure(s, f"{p}: which request ran in which step") for p, s in streams.items()]
    figs += [tbt_figure(streams),
             cdf_figure({p: list(metrics.ttfts(s).values()) for p, s in streams.items()},
                        "TTFT, CDF", "TTFT (ms, log)"),
             cdf_figure({p: [g for gs in metrics.tbts(s).values() for g in gs] for p, s in streams.items()},
                        "TBT, CDF", "TBT (ms, log)"),
             fill_figure(streams)]
    divs = [pio.to_html(f, include_plotlyjs=(i == 0), full_html=False, config={"displaylogo": False})
            for i, f in enumerate(figs)]
    meta = next(iter(runs.values())).meta
    focus = ""
    if all("focus" in s for s in summaries.values()) and summaries:
        who = "".join(f"<td>{html.escape(', '.join(s['focus']['victim_labels']))}</td>" for s in summaries.values())
        table = metrics_table(summaries, FOCUS_ROWS, key="focus").replace(
            "</tr>", f"</tr><tr><th>who</th>{who}</tr>", 1)
        focus = f"<h2>The requests that were decoding when {html.escape(scenario.focus)} arrived</h2>" + table
    n = len(streams)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>batchscope: {html.escape(scenario.name)}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(scenario.name)}</h1><p>{html.escape(scenario.description)}</p>
<p class="meta">model {html.escape(str(meta['model']))}, {meta['dtype']} on {meta['device']};
token budget {meta['max_num_batched_tokens']}, max {meta['max_num_seqs']} sequences; {len(scenario.arrivals)} requests,
{scenario.total_output_tokens} output tokens; arrivals on the {scenario.clock} clock; {html.escape(meta['created'])}</p>
<h2>Metrics</h2>{"<p class='meta'>Medians of %d runs per policy; the charts show the last run.</p>" % repeats
                 if repeats > 1 else ""}
{metrics_table(summaries)}{focus}
<p class="meta">TTFT = first token - arrival; TBT = gap between consecutive tokens of one request; a stall is a TBT
during which a step left the request out. Throughput counts every output token from the first arrival to the \
last token.</p>
<h2>Gantt charts</h2>{''.join(divs[:n])}
<h2>Latency</h2>{''.join(divs[n:n + 3])}
<h2>Budget fill</h2>{divs[n + 3]}
</body></html>"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
