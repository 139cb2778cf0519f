// The batch bar, under the Gantt: what each step computed (decode tokens, prefill tokens and the unused
// token budget), on its own canvas with the Gantt's x mapping (the window from layout.js) and label
// column (draw.LABEL_W); with the pair's workers, one bar per lane. Text goes on canvas only.
import { draw, drawMarkers, fit, laneName } from "./draw.js";
import { t } from "./i18n.js";
import { layout } from "./layout.js";
import { colorOf, colors, prefillPattern, unusedPattern } from "./palette.js";
import { rec as R } from "./record.js";   // record fields are read through record.js


// one bar chart, or with workers one per lane (stacked, prefill on top), each against its own budget
export function drawBar(bar, win) {
  const { g, w, h } = fit(bar);
  g.clearRect(0, 0, w, h);
  if (!win) return;
  const lanes = layout.lanesOf(win);
  if (!lanes) drawBarLane(g, win, win.steps, win.last, 16, h - 4, null);
  else {
    const lh = (h - 4) / lanes.length;
    lanes.forEach((lane, i) => {
      const steps = win.steps.filter((s) => layout.laneOf(s) === lane);
      if (steps.length) drawBarLane(g, win, steps, steps[steps.length - 1], i * lh + 16, (i + 1) * lh - 4, lane);
      if (i > 0) { g.fillStyle = colors.ink; g.fillRect(0, i * lh, w, 1); }
    });
  }
  drawMarkers(g, win, 0, h, false);
}

function drawBarLane(g, win, steps, last, top, bottom, lane) {
  const H = bottom - top;
  let ymax = 1;
  for (const s of steps) ymax = Math.max(ymax, R.budget(s), R.numTokens(s));
  const budgetNow = R.budget(last);
  ymax = Math.min(ymax, budgetNow * 2.5) * 1.04;
  const Y = (v) => bottom - Math.min(v, ymax) / ymax * H;

  g.font = "11px sans-serif"; g.fillStyle = colors.soft; g.textAlign = "right"; g.textBaseline = "middle";
  g.fillText("0", draw.LABEL_W - 6, bottom - 4);
  g.fillText(t("bar.budget") + " " + budgetNow, draw.LABEL_W - 6, Y(budgetNow));
  g.textAlign = "left"; g.textBaseline = "top";
  g.fillText(lane ? laneName(lane) + ": " + t("bar.axis") : t("bar.axis"), 4, top - 14);

  g.textAlign = "center";
  for (const s of steps) {
    const x = draw.LABEL_W + win.x(s), cw = win.w(s);
    if (x + cw < draw.LABEL_W) continue;
    const x0 = Math.max(draw.LABEL_W, x), wid = Math.max(1, cw - (cw > 5 ? 1 : 0) - (x0 - x));
    let v = 0;
    for (const it of R.items(s)) {            // decodes first, as the record lists them
      const y1 = Y(v), y2 = Math.min(Y(v + R.tokens(it)), y1 - 1.5);
      const color = colorOf(R.label(it));
      g.fillStyle = R.isDecode(it) ? color : prefillPattern(g, color);
      g.fillRect(x0, y2, wid, y1 - y2);
      v = Math.max(v + R.tokens(it), ymax * (bottom - y2) / H);
    }
    const used = R.numTokens(s);
    if (R.budget(s) <= 32 && wid >= 6 && H / ymax >= 4) {   // a small budget: one slot per token, so a step's shape reads off
      g.globalAlpha = 0.85; g.fillStyle = colors.paper;
      for (let k = 1; k < Math.max(R.budget(s), used); k++) g.fillRect(x0, Math.round(Y(k)), wid, 1);
      g.globalAlpha = 1;
    }
    if (R.budget(s) > used) {
      const yb = Y(R.budget(s)), yu = Math.min(Y(Math.max(used, v)), bottom);
      g.fillStyle = unusedPattern(g); g.fillRect(x0, yb, wid, yu - yb);
    }
    if (used > ymax) {                     // clipped: say how big it really was
      g.fillStyle = colors.ink; g.fillRect(x0, top - 2, wid, 2);
    }
    if (used > R.budget(s) && (wid >= 26 || used > ymax)) {
      g.fillStyle = colors.ink; g.font = "bold 11px sans-serif"; g.textBaseline = "bottom";
      g.fillText(String(used), x0 + wid / 2, Math.max(top, Y(used)) - 1);
    }
  }
  // the budget line, which the bars may exceed under static and continuous batching
  g.save(); g.setLineDash([6, 4]); g.strokeStyle = colors.ink; g.lineWidth = 1.5;
  g.beginPath();
  let started = false;
  for (const s of steps) {
    const x = Math.max(draw.LABEL_W, draw.LABEL_W + win.x(s)), y = Math.round(Y(R.budget(s))) + 0.5;
    if (!started) { g.moveTo(x, y); started = true; } else g.lineTo(x, y);
    g.lineTo(draw.LABEL_W + win.x(s) + win.w(s), y);
  }
  g.stroke(); g.restore();
}
