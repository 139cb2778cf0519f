"""The arena's HTML report: one self-contained page (plotly embedded) from the report's JSON document.

Per workload: the score table (simulator and real engine), goodput per SLO class, one Gantt
chart per policy (which request ran in which step, stalls in red), TBT over time, and how
far the simulator was from the engine when both ran.
"""
from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from app.readers.report import _LAYOUT, CSS, _color, gantt_figure, tbt_figure

ROWS = [("goodput", "goodput: both SLOs met", 100, "%"), ("ttft_met", "TTFT SLO met", 100, "%"),
        ("tbt_met", "TBT SLO met", 100, "%"), ("output_tokens_per_s", "output tokens/s", 1, ""),
        ("stall_max_s", "longest stall (ms)", 1e3, ""), ("ttft_p50_s", "TTFT p50 (ms)", 1e3, ""),
        ("ttft_p99_s", "TTFT p99 (ms)", 1e3, ""), ("tbt_p99_s", "TBT p99 (ms)", 1e3, ""),
        ("num_preemptions", "preemptions", 1, ""), ("num_steps", "steps", 1, ""), ("duration_s", "duration (s)", 1, "")]


def fmt(v, scale, unit="") -> str:
    if v is None:
        return "–"
    x = v * scale
    return (f"{x:,.0f}" if abs(x) >= 10 or float(x).is_integer() else f"{x:.2f}") + unit


def score_table(results: list[dict], part: str) -> str:
    cols = [r for r in results if r.get(part)]
    if not cols:
        return ""
    head = "".join(f"<th>{html.escape(r['policy'])}</th>" for r in cols)
    body = "".join(f"<tr><th>{name}</th>" + "".join(f"<td>{fmt(r[part]['score'].get(k), sc, u)}</td>" for r in cols)
                   + "</tr>" for k, name, sc, u in ROWS)
    title = "Simulator (step-cost fit)" if part == "sim" else "Real engine"
    return f"<h3>{title}</h3><table><tr><th></th>{head}</tr>{body}</table>"


def gap_table(results: list[dict]) -> str:
    cols = [r for r in results if r.get("sim_gap")]
    if not cols:
        return ""
    keys = list(cols[0]["sim_gap"])
    head = "".join(f"<th>{html.escape(r['policy'])}</th>" for r in cols)
    body = "".join(f"<tr><th>{k}{' (difference)' if k == 'goodput' else ' (relative)'}</th>"
                   + "".join(f"<td>{fmt(r['sim_gap'][k], 100, '%')}</td>" for r in cols) + "</tr>" for k in keys)
    return f"<h3>How far the simulator was from the engine</h3><table><tr><th></th>{head}</tr>{body}</table>"


def goodput_figure(results: list[dict], part: str) -> go.Figure:
    fig = go.Figure()
    cols = [r for r in results if r.get(part)]
    classes = sorted({c for r in cols for c in r[part]["score"]["goodput_by_slo"]})
    for i, r in enumerate(cols):
        by = r[part]["score"]["goodput_by_slo"]
        fig.add_bar(name=r["policy"], x=["all", *classes],
                    y=[100 * (r[part]["score"]["goodput"] or 0)] + [100 * (by.get(c) or 0) for c in classes],
                    marker_color=_color(r["policy"], i))
    fig.update_layout(**_LAYOUT, title="Goodput per SLO class (share of requests that met both SLOs)",
                      yaxis_title="%", barmode="group", yaxis_range=[0, 100])
    return fig


def write_arena_report(path: str | Path, doc: dict) -> Path:
    figs, sections = [], []
    for name, w in doc["workloads"].items():
        results = w["results"]
        part = "real" if any(r.get("real") for r in results) else "sim"
        runs = {r["policy"]: r[part]["stream"] for r in results if r.get(part)}
        mark = len(figs)
        figs.append(goodput_figure(results, part))
        figs += [gantt_figure(s, f"{p}: which request ran in which step") for p, s in runs.items()]
        figs.append(tbt_figure(runs))
        errors = "".join(f"<p class='err'>{html.escape(r['policy'])}: {html.escape(r['error'])}</p>"
                         for r in results if r["error"])
        slos = ", ".join(f"{c}: TTFT ≤ {s['ttft']:g} τ + {s['ttft_per_prompt']:g} τ per budget of prompt, "
                         f"TBT ≤ {s['tbt']:g} τ" for c, s in w["slos"].items())
        sections.append((mark, len(figs), f"""<h2>{html.escape(name)}</h2><p>{html.escape(w['description'])}</p>
<p class="meta">{w['requests']} requests; token budget {w['token_budget']}, max {w['max_num_seqs']} sequences;
τ = {w['tau_s'] * 1e3:.1f} ms; SLOs: {html.escape(slos)}. Ranking: {html.escape(' > '.join(w['ranking']))}.</p>
{errors}{score_table(results, 'sim')}{score_table(results, 'real')}{gap_table(results)}"""))
    divs = [pio.to_html(f, include_plotlyjs=(i == 0), full_html=False, config={"displaylogo": False})
            for i, f in enumerate(figs)]
    body = "".join(text + "".join(divs[a:b]) for a, b, text in sections)
    fit = doc["fit"]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>batchscope arena</title>
<style>{CSS}.err{{color:#b00}}</style></head><body><h1>Scheduler arena</h1>
<p class="meta">mode {doc['mode']}; step cost {fit['a'] * 1e3:.2f} ms + {fit['b'] * 1e6:.1f} µs per token +
{fit['c'] * 1e9:.1f} ns per context token ({html.escape(str(fit['device']))}); {html.escape(doc['created'])}.
Goodput (DistServe): the share of requests whose TTFT and longest gap between tokens both met their SLO;
τ is the predicted time of one full step on the machine that ran it, so the SLOs scale with it.</p>
{body}</body></html>"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
