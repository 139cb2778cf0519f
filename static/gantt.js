// The live Gantt chart: one row per request, one column per engine step, and
// under it the batch bar (what each step computed against its token budget).
// Drawn on two canvases that share one x mapping; a rolling window keeps it
// cheap at 30+ steps per second. Playback (pause, step, replay) is client-side:
// the store keeps every record, the view only moves a cursor over them.
(function () {
  const BS = (window.BS = window.BS || {});
  const R = BS.rec;           // record fields are read through record.js
  const LABEL_W = 132;        // px for row labels, left of both plots
  const TOP = 24;             // px above the rows, for setting-change flags
  const AXIS = 20;            // px below the rows, for the x axis
  const MIN_CELL = 3;         // px per step at the widest zoom
  const REPLAY_RATE = 8;      // steps per second while replaying
  const MIN_SPAN = 2, MAX_SPAN = 30;   // seconds shown in wall-time mode
  const ROW_H = 30, MIN_ROWS = 5, MAX_H = 420;   // the chart grows with its rows, up to MAX_H px

  const view = (BS.view = {
    mode: "live",             // live | paused | replay
    cursor: null,             // .step of the last step shown (null = the newest)
    axis: "step",             // step | time
    span: 100,                // steps in view (both axes); cells never get narrower than MIN_CELL
    windowSec: 2,             // time mode: seconds shown (follows the steps in view)
    drawn: null,              // what the last frame showed: {steps, rows, cells, x0, cw, ...} (hover and tests read it)
  });

  let gantt, bar, tip, dirty = true, lastVersion = -1, replayAcc = 0, lastFrame = 0, shrinkVotes = 0;

  // ---- the window of steps on screen ----
  function cursorIndex() {
    const steps = BS.store.steps;
    if (!steps.length) return -1;
    if (view.mode === "live" || view.cursor == null) return steps.length - 1;
    return Math.max(0, Math.min(steps.length - 1, findIndex(view.cursor)));
  }

  function findIndex(stepNum) {      // index of the last step with .step <= stepNum
    const steps = BS.store.steps;
    let lo = 0, hi = steps.length - 1, ans = 0;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (R.step(steps[mid]) <= stepNum) { ans = mid; lo = mid + 1; } else hi = mid - 1;
    }
    return ans;
  }

  function windowOf(plotW) {
    const steps = BS.store.steps, ci = cursorIndex();
    if (ci < 0) return null;
    const last = steps[ci];
    const n = Math.max(8, Math.min(view.span, Math.floor(plotW / MIN_CELL)));
    if (view.axis === "step") {
      const cw = plotW / n, first = Math.max(R.step(steps[0]), R.step(last) - n + 1);   // fill from the left first
      let i = ci;
      while (i > 0 && R.step(steps[i - 1]) >= first) i--;
      return { steps: steps.slice(i, ci + 1), x: (s) => (R.step(s) - first) * cw, w: () => cw, cw, first, last,
               xAtT: null, from: first, to: R.step(last) };
    }
    // wall time shows about the steps step mode would, each as wide as it took; the span grows at
    // once (a long stall stays in view) and shrinks slowly (no jitter)
    const span = R.tEnd(last) - R.tStart(steps[Math.max(0, ci - n + 1)]);
    const target = Math.max(MIN_SPAN, Math.min(MAX_SPAN, span));
    view.windowSec = target > view.windowSec ? target : view.windowSec * 0.97 + target * 0.03;
    const t1 = R.tEnd(last), t0 = t1 - view.windowSec, k = plotW / view.windowSec;
    let i = ci;
    while (i > 0 && R.tEnd(steps[i - 1]) > t0) i--;
    return { steps: steps.slice(i, ci + 1), x: (s) => (R.tStart(s) - t0) * k, w: (s) => Math.max(2, R.dur(s) * k),
             cw: null, t0, t1, k, last, xAtT: (t) => (t - t0) * k };
  }

  // rows: requests seen in the window, plus those still queued, oldest first
  function rowsOf(win) {
    const seen = new Map();
    const add = (rid) => { if (!seen.has(rid)) seen.set(rid, BS.store.reqs.get(rid)); };
    for (const s of win.steps) {
      for (const it of R.items(s)) add(R.req(it));
      for (const rid of R.stalled(s)) add(rid);
    }
    const tEnd = R.tEnd(win.last), tStart = win.steps.length ? R.tStart(win.steps[0]) : tEnd;
    for (const r of BS.store.reqs.values()) {
      if (r.arrived != null && r.arrived <= tEnd && (r.firstStep == null || r.firstStep > R.step(win.last)) &&
          (r.end == null || r.end >= tStart)) add(r.rid);
    }
    const rows = [...seen.values()].filter(Boolean);
    rows.sort((a, b) => (a.arrived ?? 1e18) - (b.arrived ?? 1e18) || ridNum(a.rid) - ridNum(b.rid));
    return rows;
  }

  const ridNum = (rid) => { const m = /(\d+)$/.exec(rid); return m ? +m[1] : 0; };

  // ---- drawing ----
  function fit(canvas) {
    const dpr = window.devicePixelRatio || 1, r = canvas.getBoundingClientRect();
    const w = Math.max(200, Math.round(r.width)), h = Math.max(60, Math.round(r.height));
    if (canvas.width !== w * dpr || canvas.height !== h * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { g, w, h };
  }

  function ellipsize(g, text, max) {
    if (g.measureText(text).width <= max) return text;
    while (text.length > 1 && g.measureText(text + "…").width > max) text = text.slice(0, -1);
    return text + "…";
  }

  function markerText(prev, s) {
    if (R.policy(prev) !== R.policy(s)) {
      if (R.policy(s) === "chunked") return BS.t("marker.on");
      if (R.policy(prev) === "chunked") return BS.t("marker.off") + " → " + BS.t("policy." + R.policy(s));
      return BS.t("policy." + R.policy(s));
    }
    const parts = [];
    if (R.budget(prev) !== R.budget(s)) parts.push(BS.t("bar.budget") + " " + R.budget(s));
    if (R.maxSeqs(prev) !== R.maxSeqs(s)) parts.push("max seqs " + R.maxSeqs(s));
    return parts.join(", ");
  }

  function drawGantt(resized) {
    const { g, w, h } = fit(gantt);
    g.clearRect(0, 0, w, h);
    const plotW = w - LABEL_W - 8;
    const win = windowOf(plotW);
    if (!win) {
      g.fillStyle = "#666"; g.font = "16px sans-serif"; g.textAlign = "center"; g.textBaseline = "middle";
      g.fillText(BS.t("metrics.empty"), w / 2, h / 2);
      view.drawn = { steps: [], rows: [], cells: [] };
      return null;
    }
    const rows = rowsOf(win);
    const want = Math.min(MAX_H, TOP + AXIS + Math.max(MIN_ROWS, rows.length) * ROW_H);
    if (!resized && Math.abs(want - h) > 2 && (want > h || ++shrinkVotes > 30)) {   // shrink only once it has lasted
      gantt.style.height = want + "px"; shrinkVotes = 0;
      return drawGantt(true);
    }
    if (want >= h) shrinkVotes = 0;
    const avail = h - TOP - AXIS;
    const rowH = Math.max(10, Math.min(ROW_H, Math.floor(avail / Math.max(1, rows.length))));
    const maxRows = Math.floor(avail / rowH);
    const shown = rows.length > maxRows ? rows.slice(rows.length - maxRows) : rows;
    const rowIndex = new Map(shown.map((r, i) => [r.rid, i]));
    const X = (s) => LABEL_W + win.x(s);
    const cells = [];

    // row labels and guide lines
    g.textBaseline = "middle"; g.font = "bold 14px sans-serif";
    shown.forEach((r, i) => {
      const y = TOP + i * rowH;
      if (i % 2) { g.fillStyle = "#f7f7f7"; g.fillRect(LABEL_W, y, plotW, rowH); }
      const color = BS.colorOf(r.label);
      g.fillStyle = color; g.fillRect(4, y + 3, 10, rowH - 6);
      g.fillStyle = "#111"; g.textAlign = "left";
      g.font = (rowH >= 18 ? "bold 14px" : "bold 11px") + " sans-serif";
      g.fillText(ellipsize(g, r.label, LABEL_W - 60), 19, y + rowH / 2);
      g.font = (rowH >= 18 ? "11px" : "9px") + " sans-serif"; g.fillStyle = "#666"; g.textAlign = "right";
      g.fillText(r.rid, LABEL_W - 6, y + rowH / 2);
    });
    if (rows.length > shown.length) {
      g.fillStyle = "#666"; g.font = "11px sans-serif"; g.textAlign = "left";
      g.fillText("+" + (rows.length - shown.length) + " ↑", 4, TOP - 8);
    }

    // queued spans: from arrival to the first step that ran the request
    g.save(); g.setLineDash([4, 4]); g.strokeStyle = "#555"; g.lineWidth = 2;
    for (const r of shown) {
      if (r.arrived == null) continue;
      const i = rowIndex.get(r.rid), y = TOP + i * rowH + rowH / 2;
      let xa, xb;
      if (win.xAtT) {
        xa = win.xAtT(r.arrived);
        const fs = r.firstStep != null && r.firstStep <= R.step(win.last) ? stepRec(r.firstStep) : null;
        xb = fs ? win.x(fs) : win.xAtT(win.t1);
      } else {
        const sa = win.steps.find((s) => R.tEnd(s) >= r.arrived);
        if (!sa) continue;
        xa = win.x(sa);
        xb = r.firstStep != null && r.firstStep <= R.step(win.last) ? (r.firstStep - win.first) * win.cw : plotW;
      }
      xa = Math.max(0, xa); xb = Math.min(plotW, xb);
      if (xb - xa > 2) { g.beginPath(); g.moveTo(LABEL_W + xa, y); g.lineTo(LABEL_W + xb - 2, y); g.stroke(); }
    }
    g.restore();

    // cells
    g.textAlign = "center"; g.textBaseline = "middle";
    for (const s of win.steps) {
      const x = X(s), cw = win.w(s);
      if (x + cw < LABEL_W) continue;
      const x0 = Math.max(LABEL_W, x), wid = Math.max(1, cw - (cw > 5 ? 1 : 0) - (x0 - x));
      for (const it of R.items(s)) {
        const i = rowIndex.get(R.req(it));
        if (i === undefined) continue;
        const y = TOP + i * rowH + 2, hh = rowH - 4, color = BS.colorOf(R.label(it));
        if (R.isDecode(it) && (win.cw || wid < 8)) {
          g.fillStyle = color; g.fillRect(x0, y, wid, hh);
        } else if (R.isDecode(it)) {
          // wall time: one token, arriving at the end of the step; the pale body is the wait for it
          const tick = Math.min(6, wid * 0.4);
          g.globalAlpha = 0.35; g.fillStyle = color; g.fillRect(x0, y, wid - tick, hh); g.globalAlpha = 1;
          g.fillRect(x0 + wid - tick, y, tick, hh);
        } else {
          g.fillStyle = BS.prefillPattern(g, color); g.fillRect(x0, y, wid, hh);
          g.strokeStyle = color; g.lineWidth = 1.5; g.strokeRect(x0 + 0.75, y + 0.75, wid - 1.5, hh - 1.5);
          const txt = wid >= 44 ? "P " + R.tokens(it) : wid >= 12 && hh >= 12 ? "P" : "";
          if (txt) {
            g.font = "bold " + (hh >= 18 ? 12 : 10) + "px sans-serif";
            g.fillStyle = "rgba(255,255,255,.85)";
            const tw = g.measureText(txt).width + 4;
            g.fillRect(x0 + wid / 2 - tw / 2, y + hh / 2 - 7, tw, 14);
            g.fillStyle = "#111"; g.fillText(txt, x0 + wid / 2, y + hh / 2 + 1);
          }
        }
        cells.push({ step: R.step(s), req: R.req(it), label: R.label(it), kind: R.kind(it), tokens: R.tokens(it), x: x0, y, w: wid, h: hh });
      }
      for (const rid of R.stalled(s)) {
        const i = rowIndex.get(rid);
        if (i === undefined) continue;
        const y = TOP + i * rowH + 2, hh = rowH - 4;
        g.fillStyle = BS.stallPattern(g); g.fillRect(x0, y, wid, hh);
        g.strokeStyle = "#222"; g.lineWidth = 1.5; g.strokeRect(x0 + 0.75, y + 0.75, wid - 1.5, hh - 1.5);
        if (wid >= 80 && hh >= 14) {
          const txt = "stall " + fmtMs(R.dur(s));
          g.font = "bold 11px sans-serif";
          const tw = g.measureText(txt).width + 6;
          g.fillStyle = "#fff"; g.fillRect(x0 + wid / 2 - tw / 2, y + hh / 2 - 7, tw, 14);
          g.fillStyle = "#111"; g.fillText(txt, x0 + wid / 2, y + hh / 2 + 1);
        }
        const req = BS.store.reqs.get(rid);
        cells.push({ step: R.step(s), req: rid, label: req ? req.label : rid, kind: "stall", tokens: 0, x: x0, y, w: wid, h: hh });
      }
    }

    // missed steps (slow connection) in step mode
    if (win.cw) {
      for (const gp of BS.store.gaps) {
        const a = Math.max(gp.after + 1, win.first), b = Math.min(gp.before - 1, R.step(win.last));
        if (b < a) continue;
        const xa = LABEL_W + (a - win.first) * win.cw, xb = LABEL_W + (b + 1 - win.first) * win.cw;
        g.fillStyle = "rgba(0,0,0,.06)"; g.fillRect(xa, TOP, xb - xa, avail);
        g.fillStyle = "#555"; g.font = "11px sans-serif"; g.fillText("…", (xa + xb) / 2, TOP + avail / 2);
      }
    }

    if (win.cw) labelLongSteps(g, win);
    const markers = drawMarkers(g, win, TOP - 20, h - AXIS, true);
    drawAxis(g, win, h - AXIS, plotW);
    view.drawn = { steps: win.steps.map((s) => R.step(s)), rows: shown.map((r) => ({ rid: r.rid, label: r.label })),
                   cells, markers, rowH, win };
    return win;
  }

  // step mode hides how long a step took: say it above the steps far slower than the rest
  function labelLongSteps(g, win) {
    const d = win.steps.map((s) => R.dur(s)).sort((a, b) => a - b);
    const median = d[d.length >> 1] || 0;
    if (d.length < 5) return;
    const slow = win.steps.filter((s) => R.dur(s) >= Math.max(4 * median, 0.2))
      .sort((a, b) => R.dur(b) - R.dur(a));
    g.font = "bold 12px sans-serif"; g.textAlign = "center"; g.textBaseline = "middle";
    const taken = [];                     // the longest get their label first; others only where it fits
    for (const s of slow) {
      const x = LABEL_W + win.x(s) + win.cw / 2, txt = fmtMs(R.dur(s)), tw = g.measureText(txt).width + 8;
      if (taken.some(([a, b]) => x + tw / 2 > a && x - tw / 2 < b)) continue;
      taken.push([x - tw / 2, x + tw / 2]);
      g.fillStyle = "#fff"; g.fillRect(x - tw / 2, TOP - 19, tw, 16);
      g.strokeStyle = "#111"; g.lineWidth = 1; g.strokeRect(x - tw / 2 + 0.5, TOP - 18.5, tw - 1, 15);
      g.fillStyle = "#111"; g.fillText(txt, x, TOP - 10.5);
    }
  }

  function stepRec(stepNum) {
    const steps = BS.store.steps, i = findIndex(stepNum);
    return steps[i] && R.step(steps[i]) === stepNum ? steps[i] : null;
  }

  function drawMarkers(g, win, yTop, yBottom, flags) {
    const steps = BS.store.steps, out = [];
    for (const s of win.steps) {
      const i = findIndex(R.step(s));
      if (i === 0) continue;
      const prev = steps[i - 1];
      if (R.settingKey(prev) === R.settingKey(s)) continue;
      const x = Math.round(LABEL_W + win.x(s)) - 1;
      if (x < LABEL_W) continue;
      g.fillStyle = "#111"; g.fillRect(x - 1, yTop, 3, yBottom - yTop);
      const txt = markerText(prev, s);
      out.push({ step: R.step(s), x, text: txt, policy: R.policy(s) });
      if (flags) {
        g.font = "bold 12px sans-serif";
        const tw = g.measureText(txt).width + 10;
        const bx = Math.min(x + 2, g.canvas.width / (window.devicePixelRatio || 1) - tw);
        g.fillStyle = "#111"; g.fillRect(bx, yTop, tw, 18);
        g.fillStyle = "#fff"; g.textAlign = "left"; g.textBaseline = "middle";
        g.fillText(txt, bx + 5, yTop + 9.5);
        g.textAlign = "center";
      }
    }
    return out;
  }

  function drawAxis(g, win, y, plotW) {
    g.strokeStyle = "#999"; g.lineWidth = 1;
    g.beginPath(); g.moveTo(LABEL_W, y + 0.5); g.lineTo(LABEL_W + plotW, y + 0.5); g.stroke();
    g.fillStyle = "#444"; g.font = "11px sans-serif"; g.textAlign = "center"; g.textBaseline = "top";
    if (win.cw) {
      const every = Math.max(1, Math.ceil(60 / win.cw / 5) * 5);
      for (let s = Math.ceil(win.first / every) * every; s <= R.step(win.last); s += every) {
        const x = LABEL_W + (s - win.first + 0.5) * win.cw;
        g.fillRect(x, y, 1, 4); g.fillText(String(s), x, y + 5);
      }
      g.textAlign = "left"; g.fillText(BS.t("axis.step"), 4, y + 5);
    } else {
      const every = view.windowSec > 20 ? 5 : view.windowSec > 6 ? 1 : 0.5;
      for (let t = Math.ceil(win.t0 / every) * every; t <= win.t1; t += every) {
        const x = LABEL_W + win.xAtT(t);
        g.fillRect(x, y, 1, 4); g.fillText(t.toFixed(every < 1 ? 1 : 0) + " s", x, y + 5);
      }
      g.textAlign = "left"; g.fillText(BS.t("axis.time"), 4, y + 5);
    }
  }

  function drawBar(win) {
    const { g, w, h } = fit(bar);
    g.clearRect(0, 0, w, h);
    if (!win) return;
    const top = 16, bottom = h - 4, H = bottom - top;
    let ymax = 1;
    for (const s of win.steps) ymax = Math.max(ymax, R.budget(s), R.numTokens(s));
    const budgetNow = R.budget(win.last);
    ymax = Math.min(ymax, budgetNow * 2.5) * 1.04;
    const Y = (v) => bottom - Math.min(v, ymax) / ymax * H;

    g.font = "11px sans-serif"; g.fillStyle = "#444"; g.textAlign = "right"; g.textBaseline = "middle";
    g.fillText("0", LABEL_W - 6, bottom - 4);
    g.fillText(BS.t("bar.budget") + " " + budgetNow, LABEL_W - 6, Y(budgetNow));
    g.textAlign = "left"; g.textBaseline = "top"; g.fillText("tokens / step", 4, 2);

    g.textAlign = "center";
    for (const s of win.steps) {
      const x = LABEL_W + win.x(s), cw = win.w(s);
      if (x + cw < LABEL_W) continue;
      const x0 = Math.max(LABEL_W, x), wid = Math.max(1, cw - (cw > 5 ? 1 : 0) - (x0 - x));
      let v = 0;
      for (const it of R.items(s)) {            // decodes first, as the record lists them
        const y1 = Y(v), y2 = Math.min(Y(v + R.tokens(it)), y1 - 1.5);
        const color = BS.colorOf(R.label(it));
        g.fillStyle = R.isDecode(it) ? color : BS.prefillPattern(g, color);
        g.fillRect(x0, y2, wid, y1 - y2);
        v = Math.max(v + R.tokens(it), ymax * (bottom - y2) / H);
      }
      const used = R.numTokens(s);
      if (R.budget(s) <= 32 && wid >= 6 && H / ymax >= 4) {   // a small budget: one slot per token, so a step's shape reads off
        g.fillStyle = "rgba(255,255,255,.85)";
        for (let k = 1; k < Math.max(R.budget(s), used); k++) g.fillRect(x0, Math.round(Y(k)), wid, 1);
      }
      if (R.budget(s) > used) {
        const yb = Y(R.budget(s)), yu = Math.min(Y(Math.max(used, v)), bottom);
        g.fillStyle = BS.unusedPattern(g); g.fillRect(x0, yb, wid, yu - yb);
      }
      if (used > ymax) {                     // clipped: say how big it really was
        g.fillStyle = "#111"; g.fillRect(x0, top - 2, wid, 2);
      }
      if (used > R.budget(s) && (wid >= 26 || used > ymax)) {
        g.fillStyle = "#111"; g.font = "bold 11px sans-serif"; g.textBaseline = "bottom";
        g.fillText(String(used), x0 + wid / 2, Math.max(top, Y(used)) - 1);
      }
    }
    // the budget line, which the bars may exceed under static and continuous batching
    g.save(); g.setLineDash([6, 4]); g.strokeStyle = "#111"; g.lineWidth = 1.5;
    g.beginPath();
    let started = false;
    for (const s of win.steps) {
      const x = Math.max(LABEL_W, LABEL_W + win.x(s)), y = Math.round(Y(R.budget(s))) + 0.5;
      if (!started) { g.moveTo(x, y); started = true; } else g.lineTo(x, y);
      g.lineTo(LABEL_W + win.x(s) + win.w(s), y);
    }
    g.stroke(); g.restore();
    drawMarkers(g, win, 0, h, false);
  }

  // ---- hover ----
  function stepAtX(px) {
    const d = view.drawn;
    if (!d || !d.win) return null;
    const win = d.win, x = px - LABEL_W;
    if (x < 0) return null;
    if (win.cw) return stepRec(win.first + Math.floor(x / win.cw));
    const t = win.t0 + x / win.k;
    return win.steps.find((s) => R.tStart(s) <= t && t <= R.tEnd(s)) || null;
  }

  function fmtMs(sec) { return sec < 1 ? (sec * 1000).toFixed(0) + " ms" : sec.toFixed(2) + " s"; }

  function showTip(ev, lines) {
    if (!lines) { tip.hidden = true; return; }
    tip.replaceChildren(...lines.map((l, i) => {
      const d = document.createElement("div");
      d.textContent = l;
      if (i === 0) d.className = "bs-tip-head";
      return d;
    }));
    tip.hidden = false;
    const host = tip.offsetParent || document.body, r = host.getBoundingClientRect();
    let x = ev.clientX - r.left + 14, y = ev.clientY - r.top + 14;
    if (x + tip.offsetWidth > r.width) x = ev.clientX - r.left - tip.offsetWidth - 10;
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }

  function stepLines(s) {
    const decodes = R.items(s).filter((i) => R.isDecode(i)).length;
    const prefill = R.items(s).filter((i) => !R.isDecode(i)).reduce((a, i) => a + R.tokens(i), 0);
    return [
      BS.t("tip.step") + " " + R.step(s) + " · " + BS.t("policy." + R.policy(s)) + " · " + BS.t("tip.dur") + " " + fmtMs(R.dur(s)),
      BS.t("tip.batch") + ": " + R.numTokens(s) + " / " + R.budget(s) + " tokens (" + decodes + " " + BS.t("kind.decode") +
        ", " + prefill + " " + BS.t("kind.prefill") + ")",
      (R.stalled(s).length ? BS.t("legend.stall").split(":")[0] + ": " + R.stalled(s).length + " · " : "") +
        "KV " + R.kvUsed(s) + " / " + R.kvTotal(s) + " · waiting " + R.waiting(s),
    ];
  }

  function onGanttMove(ev) {
    const d = view.drawn;
    const r = gantt.getBoundingClientRect(), px = ev.clientX - r.left, py = ev.clientY - r.top;
    const s = stepAtX(px);
    if (!s || !d) return showTip(ev, null);
    const row = d.rows[Math.floor((py - TOP) / d.rowH)];
    const lines = stepLines(s);
    if (row) {
      const it = R.items(s).find((i) => R.req(i) === row.rid);
      const head = row.label + " (" + row.rid + ")";
      if (it && R.isDecode(it)) lines.unshift(head + ": " + BS.t("kind.decode") + ", 1 token, position " + R.start(it));
      else if (it) {
        let l = head + ": " + BS.t("kind.prefill") + " " + R.tokens(it) + " tokens, " + R.start(it) + "–" + (R.start(it) + R.tokens(it) - 1) +
          " of " + R.promptLen(it);
        if (R.cached(it)) l += " (" + R.cached(it) + " " + BS.t("tip.cached") + ")";
        lines.unshift(head + ": " + (R.completesPrompt(it) ? BS.t("tip.first") : "…"));
        lines.unshift(l);
      } else if (R.stalled(s).includes(row.rid)) lines.unshift(head + ": " + BS.t("tip.stalled") + " (" + fmtMs(R.dur(s)) + ")" +
        (BS.stallWhy ? " · " + BS.stallWhy(s, row.rid) : ""));
      else lines.unshift(head);
    }
    showTip(ev, lines);
  }

  function onBarMove(ev) {
    const r = bar.getBoundingClientRect(), s = stepAtX(ev.clientX - r.left);
    showTip(ev, s ? stepLines(s) : null);
  }

  // ---- playback ----
  function setMode(mode) {
    const steps = BS.store.steps;
    if (mode !== "live" && view.mode === "live") view.cursor = steps.length ? R.step(steps[steps.length - 1]) : null;
    view.mode = mode;
    dirty = true;
    updatePlayUI();
  }

  BS.play = {
    pause() { setMode("paused"); },
    resume() { setMode("live"); },
    step(delta) {
      const steps = BS.store.steps;
      if (!steps.length) return;
      setMode("paused");
      const i = Math.max(0, Math.min(steps.length - 1, cursorIndex() + (delta || 1)));
      view.cursor = R.step(steps[i]);
    },
    replay() {
      const steps = BS.store.steps;
      if (!steps.length) return;
      const shown = view.drawn && view.drawn.steps.length ? view.drawn.steps[0] : R.step(steps[0]);
      setMode("replay");
      view.cursor = shown;
      replayAcc = 0;
    },
    seek(stepNum) { setMode("paused"); view.cursor = stepNum; },
    setAxis(axis) { view.axis = axis === "time" ? "time" : "step"; dirty = true; },
    zoom(steps) { view.span = Math.max(8, Math.round(steps)); dirty = true; },
  };

  function tickReplay(dt) {
    if (view.mode !== "replay") return;
    replayAcc += dt * REPLAY_RATE;
    const n = Math.floor(replayAcc);
    if (n < 1) return;
    replayAcc -= n;
    const steps = BS.store.steps, i = cursorIndex() + n;
    if (i >= steps.length - 1) { view.mode = "live"; view.cursor = null; }
    else view.cursor = R.step(steps[i]);
    dirty = true;
  }

  function updatePlayUI() {
    const steps = BS.store.steps;
    const el = document.querySelector("[data-testid=play-state]");
    if (el) {
      const ci = cursorIndex();
      const at = ci >= 0 ? " · " + BS.t("play.at") + " " + R.step(steps[ci]) : "";
      el.textContent = BS.t("play." + (view.mode === "live" ? "live" : view.mode === "replay" ? "replaying" : "paused")) + at;
      el.dataset.mode = view.mode;
    }
    const scrub = document.querySelector("[data-testid=scrub]");
    if (scrub && steps.length) {
      scrub.min = R.step(steps[0]); scrub.max = R.step(steps[steps.length - 1]);
      if (document.activeElement !== scrub) scrub.value = cursorIndex() >= 0 ? R.step(steps[cursorIndex()]) : 0;
    }
  }

  function frame(now) {
    const dt = lastFrame ? (now - lastFrame) / 1000 : 0;
    lastFrame = now;
    tickReplay(dt);
    const v = BS.store.version;
    if ((view.mode === "live" && v !== lastVersion) || dirty) {
      lastVersion = v; dirty = false;
      if (gantt.isConnected) {
        const win = drawGantt(); drawBar(win);
        if (BS.afterGantt) BS.afterGantt(gantt.getContext("2d"), view.drawn);   // views that draw over the chart
      }
      updatePlayUI();
    } else if (v !== lastVersion) {
      lastVersion = v; updatePlayUI();    // paused: the chart holds still, the scrubber grows
    }
    requestAnimationFrame(frame);
  }

  BS.redraw = () => { dirty = true; };

  BS.initGantt = function (root) {
    gantt = root.querySelector("[data-testid=gantt]");
    bar = root.querySelector("[data-testid=batch-bar]");
    tip = root.querySelector("[data-testid=tooltip]");
    gantt.addEventListener("mousemove", onGanttMove);
    bar.addEventListener("mousemove", onBarMove);
    for (const c of [gantt, bar]) c.addEventListener("mouseleave", () => { tip.hidden = true; });
    for (const c of [gantt, bar]) c.addEventListener("click", (ev) => {     // a column picked: views that show one step
      const s = stepAtX(ev.clientX - c.getBoundingClientRect().left);
      if (s && BS.onStepClick) BS.onStepClick(s);
    });
    const on = (id, fn) => { const b = root.querySelector("[data-testid=" + id + "]"); if (b) b.addEventListener("click", fn); };
    on("pause", () => BS.play.pause());
    on("resume", () => BS.play.resume());
    on("step", () => BS.play.step(1));
    on("step-back", () => BS.play.step(-1));
    on("replay", () => BS.play.replay());
    root.querySelectorAll("input[name=bs-axis]").forEach((r) =>
      r.addEventListener("change", () => { if (r.checked) BS.play.setAxis(r.value); }));
    const zoom = root.querySelector("[data-testid=zoom]");
    if (zoom) zoom.addEventListener("input", () => BS.play.zoom(+zoom.value));
    const scrub = root.querySelector("[data-testid=scrub]");
    if (scrub) scrub.addEventListener("input", () => BS.play.seek(+scrub.value));
    document.addEventListener("keydown", (e) => {
      if (/^(INPUT|TEXTAREA|SELECT|BUTTON)$/.test(e.target.tagName) || e.target.isContentEditable) return;
      if (e.key === " ") { e.preventDefault(); view.mode === "live" ? BS.play.pause() : BS.play.resume(); }
      else if (e.key === "ArrowRight") BS.play.step(1);
      else if (e.key === "ArrowLeft") BS.play.step(-1);
    });
    window.addEventListener("resize", () => { dirty = true; });
    BS.onLang(() => { dirty = true; });
    requestAnimationFrame(frame);
  };
})();
