"""A small static figure for the docs: time between tokens under each policy, as plain SVG.

No plotting library: the SVG is written by hand, so it renders on GitHub and
in any browser, and costs a few kilobytes.

    python -m demos.compare.figure --traces out/traces --scenario long-prompt-interrupts \\
        --policies continuous,chunked --out docs/figures/long-prompt-interrupts.svg
"""
from __future__ import annotations

import argparse
import html
import math
from pathlib import Path

from app.readers import metrics
from demos.compare import trace

PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
W, PANEL_H, LEFT, RIGHT, TOP, GAP = 820, 190, 70, 20, 40, 70
X_FROM = -1.0       # seconds before the focus request's arrival shown: ordinary decoding


def nice_ticks(hi: float, n: int = 5) -> list[float]:
    """About n round tick values from 0 to at least hi."""
    if hi <= 0:
        return [0.0, 1.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(hi / step)) + 1)]


def panel(stream: list[dict], focus_label: str, title: str, y0: float, x_max: float, y_max: float) -> list[str]:
    """One policy: TBT (ms) of the requests decoding when `focus_label` arrived, against seconds from that arrival."""
    names = metrics.labels(stream)
    focus = next(r for r, lab in names.items() if lab == focus_label)
    t_arr = metrics.arrivals(stream)[focus]
    victims = metrics.decoding_at(stream, t_arr)
    xs = nice_ticks(x_max)
    ys = nice_ticks(y_max, 4)
    pw, ph = W - LEFT - RIGHT, PANEL_H

    def px(t):
        return LEFT + pw * (t - X_FROM) / (xs[-1] - X_FROM)

    def py(v):
        return y0 + ph - ph * v / ys[-1]
    out = [f'<text x="{LEFT}" y="{y0 - 10}" font-size="14" font-weight="bold">{html.escape(title)}</text>']
    for v in ys:
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(v) + 4:.1f}" font-size="11" text-anchor="end">{v:g}</text>')
    for t in [X_FROM] + xs:
        out.append(f'<text x="{px(t):.1f}" y="{y0 + ph + 15}" font-size="11" text-anchor="middle">{t:g}</text>')
    first = metrics.token_times(stream).get(focus, [None])[0]
    if first is not None:   # the newcomer's prefill: from its arrival to its first token
        out.append(f'<rect x="{px(0):.1f}" y="{y0}" width="{max(px(first - t_arr) - px(0), 1):.1f}" height="{ph}" '
                   f'fill="#ff7f0e" opacity="0.15"/>')
    out.append(f'<line x1="{px(0):.1f}" x2="{px(0):.1f}" y1="{y0}" y2="{y0 + ph}" stroke="#ff7f0e" '
               f'stroke-dasharray="4 3"/>')
    for i, req in enumerate(victims):
        # a step line: each gap is drawn over the interval it lasted, at its height
        pts = []
        for t, g, _ in metrics.tbt_series(stream, [req]):
            a, b = t - g - t_arr, t - t_arr
            if b < X_FROM or a > xs[-1]:
                continue
            pts += [(max(a, X_FROM), g * 1e3), (min(b, xs[-1]), g * 1e3)]
        if not pts:
            continue
        path = " ".join(f"{px(t):.1f},{py(min(g, ys[-1])):.1f}" for t, g in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{PALETTE[i % 6]}" stroke-width="1.5"/>')
        out.append(f'<text x="{W - RIGHT - 4}" y="{y0 + 14 + 14 * i}" font-size="11" text-anchor="end" '
                   f'fill="{PALETTE[i % 6]}">{html.escape(names.get(req, req))}</text>')
    out.append(f'<rect x="{LEFT}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    return out


def tbt_figure(streams: dict[str, list[dict]], focus_label: str, window_s: float | None = None) -> str:
    """SVG text: one panel per policy, same axes, so the stall's height compares directly."""
    spans, peaks = [], []
    for s in streams.values():
        names = metrics.labels(s)
        focus = next(r for r, lab in names.items() if lab == focus_label)
        t_arr = metrics.arrivals(s)[focus]
        victims = metrics.decoding_at(s, t_arr)
        rows = [(t - t_arr, g) for t, g, _ in metrics.tbt_series(s, victims) if t >= t_arr]
        spans.append(max((t for t, _ in rows), default=1.0))
        peaks.append(max((g for _, g in rows), default=0.001) * 1e3)
    x_max = window_s or max(spans)
    y_max = max(peaks) * 1.05
    h = TOP + len(streams) * (PANEL_H + GAP)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" '
             f'font-family="sans-serif">', f'<rect width="{W}" height="{h}" fill="white"/>']
    for i, (policy, s) in enumerate(streams.items()):
        summary = metrics.focus_summary(s, next(r for r, lab in metrics.labels(s).items() if lab == focus_label))
        title = (f"{policy}: time between tokens of {', '.join(summary['victim_labels'])} (ms); "
                 f"p99 {summary['tbt_p99_s'] * 1e3:,.0f} ms, longest {summary['tbt_max_s'] * 1e3:,.0f} ms")
        parts += panel(s, focus_label, title, TOP + i * (PANEL_H + GAP), x_max, y_max)
    y = h - 18
    parts.append(f'<text x="{LEFT}" y="{y}" font-size="11">seconds after {html.escape(focus_label)} arrived '
                 f'(dashed line); shaded: until its first token</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.compare.figure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="out/traces", help="folder of traces written by demos.compare --traces")
    ap.add_argument("--scenario", default="long-prompt-interrupts")
    ap.add_argument("--policies", default="continuous,chunked")
    ap.add_argument("--focus", default="Doc", help="label of the request whose arrival the figure centres on")
    ap.add_argument("--out", default="out/tbt.svg")
    args = ap.parse_args(argv)
    streams = {p: trace.load(Path(args.traces) / f"{args.scenario}.{p}.json") for p in args.policies.split(",")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(tbt_figure(streams, args.focus))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
