// Drawing the chart: the Gantt (one row per request, one column per step); under it the batch
// bar (bar.js), on a second canvas that shares its x mapping (the window from layout.js) and its
// label column. Text goes on canvas or through textContent only.
import { fmt, lang, t } from "./i18n.js";
import { layout, view } from "./layout.js";
import { cachedPattern, colorOf, colors, drawLabelSwatch, edgeOf, prefillPattern, stallPattern } from "./palette.js";
import { rec as R } from "./record.js";   // record fields are read through record.js
import { store } from "./socket.js";
import { state } from "./state.js";

const C = () => colors;      // palette.js
let LABEL_W = 132;          // px for row labels, left of both plots (narrower on a phone: see drawGantt)
const TOP = 24;             // px above the rows, for setting-change flags
const AXIS = 20;            // px below the rows, for the x axis
const ROW_H = 30, MIN_ROWS = 5;   // the chart grows with its rows, up to state.chartMaxH px
const MIN_ROW_H = 10, READABLE_ROW_H = 16;   // a crowd keeps readable rows and counts the rest
const QUIET = 0.4;          // alpha of other people's cells on a student's page
const SHRINK_AFTER_MS = 1500;   // a smaller chart must be wanted this long before it shrinks (no jumping)
let shrinkSince = null, rowKey = "";
// a shrink has waited long enough: interact.js redraws for it (an idle chart gets no other redraw)
export const shrinkDue = (now) => shrinkSince != null && now - shrinkSince >= SHRINK_AFTER_MS;


// ---- canvas and text helpers ----
// the canvas in drawing units: (ctx, width, height), scaled for the screen and the view
export function fit(canvas) {
  const dpr = window.devicePixelRatio || 1, S = state.chartScale, r = canvas.getBoundingClientRect();
  const cw = Math.max(200, Math.round(r.width)), ch = Math.max(60, Math.round(r.height));
  if (canvas.width !== cw * dpr || canvas.height !== ch * dpr) { canvas.width = cw * dpr; canvas.height = ch * dpr; }
  const g = canvas.getContext("2d");
  g.setTransform(dpr * S, 0, 0, dpr * S, 0, 0);
  return { g, w: cw / S, h: ch / S };
}

// `text` in lines no wider than `max`, broken between words (a word wider than `max` keeps a line to itself)
function wrapWords(g, text, max) {
  const lines = [];
  for (const word of text.split(" ")) {
    const last = lines.length ? lines[lines.length - 1] + " " + word : null;
    if (last !== null && g.measureText(last).width <= max) lines[lines.length - 1] = last;
    else lines.push(word);
  }
  return lines;
}

function ellipsize(g, text, max) {
  if (g.measureText(text).width <= max) return text;
  while (text.length > 1 && g.measureText(text + "…").width > max) text = text.slice(0, -1);
  return text + "…";
}

export const fmtMs = (sec) => (sec < 1 ? (sec * 1000).toFixed(0) + " ms" : sec.toFixed(2) + " s");

const settingKey = R.settingKey;

// a part of a setting that is not the default, in words: the metrics table's column heads (metrics.js) and
// the chart's flags (below) both say it so
export const settingWords = {
  chunkCap: (n) => fmt("metrics.chunk_k", { n }),
  speculative: (k) => fmt("metrics.spec_k", { k }),
  kvLimit: (n) => t("metrics.kv_cap") + " " + n,
};

// the words of the setting flag at step record s: every part of the setting (record.js settingKey) that
// changed since the step before it, named as the metrics table's column heads name it; "" where none did.
// The flags, the chart's table and its live sentence (chart_text.js) all say these words.
export function settingChangeAt(s) {
  const i = layout.findIndex(R.step(s));
  const prev = i > 0 ? store.steps[i - 1] : null;
  return prev && settingKey(prev) !== settingKey(s) ? changeText(prev, s) : "";
}

function changeText(prev, s) {
  const parts = [];
  if (R.policy(prev) !== R.policy(s)) {
    if (R.policy(s) === "chunked") parts.push(t("marker.on"));
    else if (R.policy(prev) === "chunked") parts.push(t("marker.off") + " → " + t("policy." + R.policy(s)));
    else parts.push(t("policy." + R.policy(s)));
  }
  if (R.budget(prev) !== R.budget(s)) parts.push(t("bar.budget") + " " + R.budget(s));
  if (R.maxSeqs(prev) !== R.maxSeqs(s)) parts.push(t("marker.seqs") + " " + R.maxSeqs(s));
  const n = R.chunkCap(s);
  if (R.chunkCap(prev) !== n) parts.push(n != null ? settingWords.chunkCap(n) : t("page.set.no_chunk"));
  const k = R.speculative(s);
  if (R.speculative(prev) !== k) parts.push(k ? settingWords.speculative(k) : t("page.set.no_spec"));
  if (R.prefixCaching(prev) !== R.prefixCaching(s)) {
    parts.push(t(R.prefixCaching(s) ? "page.set.cache_on" : "page.set.cache_off"));
  }
  const cap = R.kvLimit(s);
  if (R.kvLimit(prev) !== cap) parts.push(cap != null ? settingWords.kvLimit(cap) : t("page.set.kv_all"));
  return parts.join(", ");
}

// ---- the Gantt: its size, then its layers in drawing order ----
function drawGantt(gantt, resized) {
  const { g, w, h } = fit(gantt), S = state.chartScale;
  g.clearRect(0, 0, w, h);
  LABEL_W = draw.LABEL_W = w < 480 ? 100 : 132;     // a phone keeps two thirds of its width for the steps
  const plotW = w - LABEL_W - 8;
  const win = layout.windowOf(plotW);
  if (!win) {
    g.fillStyle = C().muted; g.font = "16px sans-serif"; g.textAlign = "center"; g.textBaseline = "middle";
    const lines = wrapWords(g, t("metrics.empty"), w - 16);     // a phone's chart is narrower than the words
    lines.forEach((line, i) => g.fillText(line, w / 2, h / 2 + (i - (lines.length - 1) / 2) * 22));
    view.drawn = { steps: [], rows: [], cells: [], markers: [], handovers: [], rowH: null, win: null, slow: [],
                   running: null };                      // the parts of a full draw's, empty
    syncRowLabels(gantt, []);
    setNote(gantt, "");
    return null;
  }
  const grouped = state.role !== "lecturer";
  const all = layout.rowsOf(win, Infinity, grouped).rows.length;
  const want = Math.min(state.chartMaxH, (TOP + AXIS + Math.max(MIN_ROWS, all) * ROW_H) * S);
  // grow at once; shrink once the smaller size has lasted, by the clock, unless the room it was given
  // fell below its height: then at once (a page taller than the screen would scroll)
  const now = performance.now(), overRoom = h * S > state.chartMaxH + 2;
  if (want < h * S - 2) { if (shrinkSince == null) shrinkSince = now; } else shrinkSince = null;
  if (!resized && (want > h * S + 2 || overRoom || shrinkDue(now))) {
    gantt.style.height = want + "px"; shrinkSince = null;
    return drawGantt(gantt, true);
  }
  const avail = h - TOP - AXIS;
  const rowH = Math.max(grouped ? READABLE_ROW_H : MIN_ROW_H, Math.min(ROW_H, Math.floor(avail / Math.max(1, all))));
  const { rows: shown, more, collapsed } = layout.rowsOf(win, Math.floor(avail / rowH), grouped);
  const rowIndex = new Map(shown.map((r, i) => [r.key, i]));   // key: the request, or the request in a lane
  const quiet = state.role === "student" && shown.some((r) => r.mine);
  drawRowLabels(g, shown, rowH, plotW);
  const notes = [];
  if (more > 0) notes.push("+" + more + " " + t(more === 1 ? "rows.more_one" : "rows.more"));
  if (collapsed > 0) notes.push(collapsed + " " + t("rows.finished"));
  setNote(gantt, notes.join(" · "));
  drawQueued(g, win, shown, rowIndex, rowH, plotW);
  const cells = drawCells(g, win, rowIndex, rowH, quiet ? new Set(shown.filter((r) => !r.mine).map((r) => r.rid)) : null);
  const handovers = drawHandovers(g, win, rowIndex, rowH, plotW);
  const legend = document.querySelector("[data-testid=legend-handover]");
  if (legend) legend.hidden = !win.steps.some(R.worker);        // hand-overs: the disaggregated pair only
  const drafts = document.querySelector("[data-testid=legend-drafts]");
  if (drafts) drafts.hidden = !win.steps.some((s) => R.items(s).some(R.drafted));   // speculative decoding only
  if (win.axis === "step") drawGaps(g, win, avail);
  const markers = drawMarkers(g, win, TOP - 20, h - AXIS, true);
  // after the markers, so that no setting flag ever hides a slow step's duration
  const slow = win.axis === "step" ? labelLongSteps(g, win, avail) : [];
  const running = drawRunning(g, win, avail, plotW);
  drawAxis(g, win, h - AXIS, plotW);
  view.drawn = { steps: win.steps.map((s) => R.step(s)),
                    rows: shown.map((r) => ({ rid: r.rid, label: r.label, mine: r.mine, group: r.group, lane: r.lane, header: !!r.header })),
                    cells, markers, handovers, rowH, win, slow, running };
  syncRowLabels(gantt, shown);
  return win;
}

// ---- the label column ----
// row labels with each label's colour and mark; the viewer's own rows on a band, marked "you"
function drawRowLabels(g, shown, rowH, plotW) {
  g.textBaseline = "middle";
  shown.forEach((r, i) => {
    const y = TOP + i * rowH;
    if (r.header) return drawLaneHeader(g, r.lane, y, rowH, plotW, i > 0);
    if (r.mine) { g.fillStyle = C().mineBand; g.fillRect(0, y, LABEL_W + plotW, rowH); }
    else if (i % 2) { g.fillStyle = C().stripe; g.fillRect(LABEL_W, y, plotW, rowH); }
    if (i > 0 && !shown[i - 1].header && shown[i - 1].group !== r.group && state.role !== "lecturer") {
      g.fillStyle = C().rule; g.fillRect(0, y, LABEL_W + plotW, 1);
    }
    drawLabelSwatch(g, r.label, 4, y + 3, 10, rowH - 6);
    g.fillStyle = C().ink; g.textAlign = "left";
    g.font = (rowH >= 18 ? "bold 14px" : "bold 11px") + " sans-serif";
    const text = r.mine ? t("row.you") + " · " + r.label : r.label;
    const narrow = LABEL_W < 132;           // a phone: the name gets the whole label, the request id goes
    g.fillText(ellipsize(g, text, LABEL_W - (narrow ? 24 : 60)), 19, y + rowH / 2);
    g.font = (rowH >= 18 ? "11px" : "9px") + " sans-serif"; g.fillStyle = C().muted; g.textAlign = "right";
    if (!narrow) g.fillText(r.rid, LABEL_W - 6, y + rowH / 2);
    if (r.mine) { g.strokeStyle = C().ink; g.lineWidth = 2; g.strokeRect(1, y + 1, LABEL_W + plotW - 2, rowH - 2); }
  });
}

// a worker's lane starts with a band naming the worker and its share of the machine
function drawLaneHeader(g, lane, y, rowH, plotW, rule) {
  g.fillStyle = C().laneBand; g.fillRect(0, y, LABEL_W + plotW, rowH);
  if (rule) { g.fillStyle = C().ink; g.fillRect(0, y, LABEL_W + plotW, 2); }
  g.fillStyle = C().ink; g.textAlign = "left"; g.textBaseline = "middle";
  g.font = "bold " + (rowH >= 18 ? 14 : 11) + "px sans-serif";
  g.fillText(laneTitle(lane), 6, y + rowH / 2);
}

// "prefill worker", or for a vLLM data-parallel engine "vLLM engine 1"
export const laneName = (lane) => (/^dp\d+$/.test(lane) ? t("lane.dp") + " " + lane.slice(2) : t("lane." + lane));
// "prefill worker · 1 thread": the thread count from the newest step of that worker
export function laneTitle(lane) {
  const steps = store.steps;
  let threads = null;
  for (let i = steps.length - 1; i >= 0 && threads == null && lane !== "engine"; i--) if (R.worker(steps[i]) === lane) threads = R.threads(steps[i]);
  const name = laneName(lane);
  return threads == null ? name : name + " · " + threads + " " + t(threads === 1 ? "lane.thread" : "lane.threads");
}

// rows left out or collapsed: said above the chart, in the page (the canvas top holds step labels)
function setNote(gantt, text) {
  const el = gantt.parentElement && gantt.parentElement.querySelector("[data-testid=rows-note]");
  if (el && el.textContent !== text) el.textContent = text;
}

// the rows on screen as a list in the DOM, for screen readers and tests
function syncRowLabels(gantt, shown) {
  const list = gantt.parentElement && gantt.parentElement.querySelector("[data-testid=row-labels]");
  if (!list) return;
  const key = lang() + "|" + shown.map((r) => r.key + (r.mine ? "*" : "") + r.group).join(",");
  if (key === rowKey) return;
  rowKey = key;
  list.replaceChildren(...shown.map((r) => {
    const li = document.createElement("li");
    if (r.header) { li.textContent = laneTitle(r.lane); li.dataset.lane = r.lane; li.dataset.header = "true"; return li; }
    if (r.lane) li.dataset.lane = r.lane;
    li.textContent = (r.mine ? t("row.you") + ": " : "") + r.label + " (" + r.rid + ", " + t("group." + r.group) + ")";
    li.dataset.label = r.label; li.dataset.rid = r.rid; li.dataset.group = r.group;
    if (r.mine) li.dataset.mine = "true";
    return li;
  }));
}

// ---- the plot: queued spans, cells, hand-overs ----
// queued spans: from arrival to the first step that ran the request
function drawQueued(g, win, shown, rowIndex, rowH, plotW) {
  g.save(); g.setLineDash([4, 4]); g.strokeStyle = C().queued; g.lineWidth = 2;
  for (const r of shown) {
    if (r.arrived == null || r.header || (r.lane && r.lane !== layout.queueLane(win))) continue;   // a prompt queues for the prefill worker
    const req = store.reqs.get(r.rid), y = TOP + rowIndex.get(r.key) * rowH + rowH / 2;
    let xa = win.xOfTime(r.arrived);
    if (xa == null) continue;
    const fs = req.firstStep != null && req.firstStep <= win.last.step ? layout.stepRec(req.firstStep) : null;
    // until its first step; a request that ended without one (aborted while queued) until its end
    const xe = !fs && req.end != null ? win.xOfTime(req.end) : null;
    let xb = fs ? win.x(fs) : xe != null ? xe : plotW;
    xa = Math.max(0, xa); xb = Math.min(plotW, xb);
    if (xb - xa > 2) { g.beginPath(); g.moveTo(LABEL_W + xa, y); g.lineTo(LABEL_W + xb - 2, y); g.stroke(); }
  }
  g.restore();
}

function drawCells(g, win, rowIndex, rowH, quietRids) {
  const cells = [], lanes = layout.lanesOf(win);
  g.textAlign = "center"; g.textBaseline = "middle";
  for (const s of win.steps) {
    const x = LABEL_W + win.x(s), cw = win.w(s);
    if (x + cw < LABEL_W) continue;
    const x0 = Math.max(LABEL_W, x), wid = Math.max(1, cw - (cw > 5 ? 1 : 0) - (x0 - x));
    const lane = lanes ? layout.laneOf(s) : null;
    for (const it of R.items(s)) {
      const i = rowIndex.get(layout.rowKey(lane, R.req(it)));
      if (i === undefined) continue;
      const y = TOP + i * rowH + 2, hh = rowH - 4;
      g.globalAlpha = quietRids && quietRids.has(R.req(it)) ? QUIET : 1;
      drawItem(g, it, win.axis, x0, y, wid, hh);
      g.globalAlpha = 1;
      cells.push({ step: R.step(s), req: R.req(it), label: R.label(it), kind: R.kind(it), tokens: R.tokens(it), x: x0, y, w: wid, h: hh,
                   lane, t0: R.tStart(s), t1: R.tEnd(s), cached: R.cached(it) || 0 });
    }
    for (const rid of s.stalled || []) {
      const i = rowIndex.get(layout.rowKey(lane, rid));
      if (i === undefined) continue;
      const y = TOP + i * rowH + 2, hh = rowH - 4;
      drawStall(g, s, x0, y, wid, hh);
      const req = store.reqs.get(rid);
      cells.push({ step: R.step(s), req: rid, label: req ? req.label : rid, kind: "stall", tokens: 0, x: x0, y, w: wid, h: hh,
                   lane, t0: R.tStart(s), t1: R.tEnd(s) });
    }
  }
  return cells;
}

// a KV hand-over: an arrow from the request's prefill row, where the export starts (t0), to its
// decode row, where the import is done (t), labelled with its size and time where there is room
function drawHandovers(g, win, rowIndex, rowH, plotW) {
  const out = [], t0 = win.steps.length ? R.tStart(win.steps[0]) : R.tEnd(win.last), t1 = R.tEnd(win.last);
  const S = state.chartScale;
  for (const x of store.transfers) {
    if (x.t < t0 || x.t0 > t1) continue;
    const a = rowIndex.get(layout.rowKey(x.from, x.rid)), b = rowIndex.get(layout.rowKey(x.to, x.rid));
    if (a === undefined || b === undefined) continue;
    let xa = win.xOfTime(x.t0), xb = win.xOfTime(x.t);
    if (xa == null || xb == null) continue;
    xa = LABEL_W + Math.max(0, Math.min(plotW, xa)); xb = LABEL_W + Math.max(0, Math.min(plotW, xb));
    const down = b > a, ya = TOP + a * rowH + (down ? rowH - 3 : 3), yb = TOP + b * rowH + (down ? 3 : rowH - 3);
    g.save();
    g.strokeStyle = C().paper; g.lineWidth = 5.5;                // a white halo keeps it readable over any cell
    g.beginPath(); g.moveTo(xa, ya); g.lineTo(xb, yb); g.stroke();
    g.strokeStyle = C().handover; g.fillStyle = C().handover; g.lineWidth = 2.5;
    g.beginPath(); g.moveTo(xa, ya); g.lineTo(xb, yb); g.stroke();
    const ang = Math.atan2(yb - ya, xb - xa), hl = 9;           // arrowhead at the decode row
    g.beginPath(); g.moveTo(xb, yb);
    g.lineTo(xb - hl * Math.cos(ang - 0.45), yb - hl * Math.sin(ang - 0.45));
    g.lineTo(xb - hl * Math.cos(ang + 0.45), yb - hl * Math.sin(ang + 0.45));
    g.closePath(); g.fill();
    g.beginPath(); g.arc(xa, ya, 3.5, 0, 2 * Math.PI); g.fill();  // export starts here
    g.restore();
    out.push({ req: x.rid, label: x.label, x0: xa * S, x1: xb * S, y0: ya * S, y1: yb * S, blocks: x.blocks, bytes: x.bytes,
               seconds: x.seconds, text: handoverText(x), box: null });
  }
  // then the labels, over every arrow: each beside its own, moved up or down off the ones placed before it,
  // or left out (the tooltip still has it)
  const taken = [];                                            // [x, y, w] of the label boxes placed so far
  g.save();
  g.font = "bold 11px sans-serif"; g.textAlign = "left"; g.textBaseline = "middle";
  for (const m of out) {
    const xa = m.x0 / S, xb = m.x1 / S, ya = m.y0 / S, yb = m.y1 / S;
    const tw = g.measureText(m.text).width + 8, xm = Math.min(Math.max(xa, xb) + 6, LABEL_W + plotW - tw);
    const ym = [0, 18, -18, 36, -36].map((d) => (ya + yb) / 2 + d)
      .find((y) => !taken.some(([x, yy, w]) => Math.abs(y - yy) < 17 && xm < x + w + 4 && x < xm + tw + 4));
    if (Math.abs(yb - ya) < 14 || ym === undefined) continue;
    taken.push([xm, ym, tw]);
    g.fillStyle = C().paper; g.fillRect(xm, ym - 8, tw, 16);
    g.strokeStyle = C().handover; g.lineWidth = 1; g.strokeRect(xm + 0.5, ym - 7.5, tw - 1, 15);
    g.fillStyle = C().ink; g.fillText(m.text, xm + 4, ym + 0.5);
    m.box = [xm * S, (ym - 8) * S, tw * S, 16 * S];
  }
  g.restore();
  return out;
}

export const fmtBytes = (n) => (n >= 1e6 ? (n / 1e6).toFixed(1) + " MB" : n >= 1e3 ? (n / 1e3).toFixed(0) + " kB" : n + " B");
// "KV 12 blocks · 1.4 MB · 3 ms"
export const handoverText = (x) => t("handover.kv") + " " + x.blocks + " " + t("handover.blocks") + " · " + fmtBytes(x.bytes) + " · " + fmtMs(x.seconds);

// a cell's edge (palette.js edgeOf): 3:1 against the row behind it, where the cell is wide enough to keep its fill
function drawEdge(g, color, x0, y, wid, hh) {
  if (wid < 4) return;
  g.strokeStyle = edgeOf(color); g.lineWidth = 1; g.strokeRect(x0 + 0.5, y + 0.5, wid - 1, hh - 1);
}

// a decode that verified drafts (speculative decoding): its cell cut into 1 + drafted slices, left to right
// (top to bottom where too narrow): its own token solid, each kept draft solid with a paper dot, each
// rejected draft paper with a cross in the reply's colour. Shape tells them apart, not colour alone.
function drawDrafts(g, it, x0, y, wid, hh, color) {
  const n = 1 + R.drafted(it), across = wid / n >= 4;
  const sw = across ? wid / n : wid, sh = across ? hh : hh / n;
  for (let k = 0; k < n; k++) {
    const x = across ? x0 + k * sw : x0, yy = across ? y : y + k * sh;
    const w = Math.max(1, sw - (across && k < n - 1 ? 1 : 0)), h = Math.max(1, sh - (!across && k < n - 1 ? 1 : 0));
    const cx = x + w / 2, cy = yy + h / 2, r = Math.max(1, Math.min(w, h) / 3);
    if (k <= R.accepted(it)) {
      g.fillStyle = color; g.fillRect(x, yy, w, h);
      if (k > 0) { g.fillStyle = C().paper; g.beginPath(); g.arc(cx, cy, r, 0, 2 * Math.PI); g.fill(); }
    } else {
      g.fillStyle = C().paper; g.fillRect(x, yy, w, h);
      g.strokeStyle = edgeOf(color); g.lineWidth = 1.5;
      g.beginPath(); g.moveTo(cx - r, cy - r); g.lineTo(cx + r, cy + r); g.moveTo(cx + r, cy - r); g.lineTo(cx - r, cy + r);
      g.stroke();
    }
  }
}

function drawItem(g, it, axis, x0, y, wid, hh) {
  const color = colorOf(R.label(it));
  if (R.isDecode(it) && R.drafted(it) && axis === "step") {
    drawDrafts(g, it, x0, y, wid, hh, color);
    drawEdge(g, color, x0, y, wid, hh);
  } else if (R.isDecode(it) && R.drafted(it)) {
    // wall time: the wait for the step pale, then its own token and the drafts where they arrive, at its end
    const tail = Math.min(wid, Math.max(6, 5 * (1 + R.drafted(it)))), alpha = g.globalAlpha;
    g.globalAlpha = alpha * 0.35; g.fillStyle = color; g.fillRect(x0, y, wid - tail, hh); g.globalAlpha = alpha;
    drawDrafts(g, it, x0 + wid - tail, y, tail, hh, color);
  } else if (R.isDecode(it) && (axis === "step" || wid < 8)) {
    g.fillStyle = color; g.fillRect(x0, y, wid, hh);
    drawEdge(g, color, x0, y, wid, hh);
  } else if (R.isDecode(it)) {
    // wall time: one token, arriving at the end of the step; the pale body is the wait for it
    const tick = Math.min(6, wid * 0.4), alpha = g.globalAlpha;
    g.globalAlpha = alpha * 0.35; g.fillStyle = color; g.fillRect(x0, y, wid - tick, hh); g.globalAlpha = alpha;
    g.fillRect(x0 + wid - tick, y, tick, hh);
    drawEdge(g, color, x0, y, wid, hh);
  } else {
    // a first chunk after a prefix-cache hit: the cached tokens (dotted, dashed outline: read, not computed)
    // take the cell's left part in proportion to the tokens, the computed ones (striped) the rest
    const hit = R.cached(it) || 0, cw = hit ? Math.round(wid * hit / (hit + R.tokens(it))) : 0;
    if (cw >= 2) {
      g.fillStyle = cachedPattern(g, color); g.fillRect(x0, y, cw, hh);
      g.save(); g.setLineDash([3, 2]); g.strokeStyle = edgeOf(color); g.lineWidth = 1.5;
      g.strokeRect(x0 + 0.75, y + 0.75, cw - 1.5, hh - 1.5); g.restore();
      cellLabel(g, wid >= 44 ? t("cell.cached") + " " + hit : cw >= 12 && hh >= 12 ? t("cell.cached_short") : "",
                x0, y, cw, hh);
    }
    const xp = x0 + (cw >= 2 ? cw : 0), wp = Math.max(1, wid - (xp - x0));
    g.fillStyle = prefillPattern(g, color); g.fillRect(xp, y, wp, hh);
    g.strokeStyle = edgeOf(color); g.lineWidth = 1.5; g.strokeRect(xp + 0.75, y + 0.75, wp - 1.5, hh - 1.5);
    const p = t("cell.prefill");
    cellLabel(g, wp >= 44 ? p + " " + R.tokens(it) : wp >= 12 && hh >= 12 ? p : "", xp, y, wp, hh);
  }
}

function cellLabel(g, txt, x0, y, wid, hh) {
  if (!txt) return;
  g.font = "bold " + (hh >= 18 ? 12 : 10) + "px sans-serif";
  g.fillStyle = C().labelBack;
  const tw = g.measureText(txt).width + 4;
  g.fillRect(x0 + wid / 2 - tw / 2, y + hh / 2 - 7, tw, 14);
  g.fillStyle = C().ink; g.fillText(txt, x0 + wid / 2, y + hh / 2 + 1);
}

function drawStall(g, s, x0, y, wid, hh) {
  g.fillStyle = stallPattern(g); g.fillRect(x0, y, wid, hh);
  g.strokeStyle = C().stallLine; g.lineWidth = 1.5; g.strokeRect(x0 + 0.75, y + 0.75, wid - 1.5, hh - 1.5);
  if (wid >= 80 && hh >= 14) {
    const txt = t("cell.stall") + " " + fmtMs(R.dur(s));
    g.font = "bold 11px sans-serif";
    const tw = g.measureText(txt).width + 6;
    g.fillStyle = C().paper; g.fillRect(x0 + wid / 2 - tw / 2, y + hh / 2 - 7, tw, 14);
    g.fillStyle = C().ink; g.fillText(txt, x0 + wid / 2, y + hh / 2 + 1);
  }
}

// ---- over the plot: gaps, slow steps, the running step, setting flags, the axis ----
// missed steps (slow connection), step axis only: they have no times to place them by
function drawGaps(g, win, avail) {
  const first = win.steps.length ? win.steps[0].step : win.last.step;
  for (const gp of store.gaps) {
    const a = Math.max(gp.after + 1, first), b = Math.min(gp.before - 1, win.last.step);
    if (b < a) continue;
    const xa = LABEL_W + win.xOfStep(a), xb = LABEL_W + win.xOfStep(b + 1);
    g.fillStyle = C().gap; g.fillRect(xa, TOP, xb - xa, avail);
    g.fillStyle = C().queued; g.font = "11px sans-serif"; g.fillText("…", (xa + xb) / 2, TOP + avail / 2);
  }
}

// the step axis hides how long a step took: a step far slower than its neighbours gets an ink frame over its
// whole column and its duration in a box on the column, at the top of the plot (below the setting flags, drawn
// over them)
function labelLongSteps(g, win, avail) {
  const d = win.steps.map((s) => R.dur(s)).sort((a, b) => a - b);
  const median = d[d.length >> 1] || 0, out = [];
  if (d.length < 5) return out;
  const slow = win.steps.filter((s) => R.dur(s) >= Math.max(4 * median, 0.2))
    .sort((a, b) => R.dur(b) - R.dur(a));
  g.font = "bold 13px sans-serif"; g.textAlign = "center"; g.textBaseline = "middle";
  const taken = [];                     // the longest get their label first; others only where it fits
  for (const s of slow) {
    const x0 = LABEL_W + win.x(s), cw = Math.max(2, win.w(s));
    if (x0 + cw < LABEL_W) continue;
    const x = x0 + cw / 2, txt = fmtMs(R.dur(s)), tw = g.measureText(txt).width + 10;
    const bx = Math.max(LABEL_W, Math.min(x - tw / 2, g.canvas.width / (window.devicePixelRatio || 1) / state.chartScale - tw));
    if (taken.some(([a, b]) => bx + tw > a && bx < b)) { out.push({ step: R.step(s), text: txt, shown: false }); continue; }
    taken.push([bx, bx + tw]);
    g.strokeStyle = C().ink; g.lineWidth = 2; g.strokeRect(x0 - 1, TOP - 1, cw + 2, avail + 2);
    g.fillStyle = C().ink; g.fillRect(bx, TOP + 2, tw, 18);
    g.fillStyle = C().paper; g.fillText(txt, bx + tw / 2, TOP + 11.5);
    out.push({ step: R.step(s), text: txt, shown: true, x: bx * state.chartScale, y: (TOP + 2) * state.chartScale,
               box: { x: bx, y: TOP + 2, w: tw, h: 18 } });   // in drawing units, as the cells' x, y, w, h
  }
  return out;
}

// live, and no step has come for a while though requests are in: a step is running (a long prefill,
// say). Say so at the chart's right edge, with the time it has taken so far, instead of freezing.
function drawRunning(g, win, avail, plotW) {
  const el = store.runningFor();
  if (el == null || view.mode !== "live") return null;
  const x = Math.min(LABEL_W + plotW - 4, LABEL_W + win.x(win.last) + win.w(win.last) + 2);
  g.save(); g.setLineDash([5, 4]); g.strokeStyle = C().ink; g.lineWidth = 2;
  g.beginPath(); g.moveTo(x + 1, TOP); g.lineTo(x + 1, TOP + avail); g.stroke(); g.restore();
  const txt = t("chart.running") + " " + fmtMs(el);
  g.font = "bold 13px sans-serif"; g.textAlign = "left"; g.textBaseline = "middle";
  const tw = g.measureText(txt).width + 10, bx = Math.max(LABEL_W, Math.min(x + 4, LABEL_W + plotW - tw));
  g.fillStyle = C().paper; g.fillRect(bx, TOP + avail / 2 - 10, tw, 20);
  g.strokeStyle = C().ink; g.lineWidth = 1.5; g.strokeRect(bx + 0.5, TOP + avail / 2 - 9.5, tw - 1, 19);
  g.fillStyle = C().ink; g.fillText(txt, bx + 5, TOP + avail / 2 + 0.5);
  return { seconds: el, text: txt };
}

export function drawMarkers(g, win, yTop, yBottom, flags) {
  const out = [], S = state.chartScale;
  for (const s of win.steps) {
    const txt = settingChangeAt(s);
    if (!txt) continue;
    const x = Math.round(LABEL_W + win.x(s)) - 1;
    if (x < LABEL_W) continue;
    g.fillStyle = C().ink; g.fillRect(x - 1, yTop, 3, yBottom - yTop);
    // boxes: the ink it draws over the cells, in drawing units (as the cells' x, y, w, h)
    const m = { step: R.step(s), x: x * S, text: txt, policy: R.policy(s), boxes: [{ x: x - 1, y: yTop, w: 3, h: yBottom - yTop }] };
    out.push(m);
    if (flags) {
      g.font = "bold 12px sans-serif";
      const tw = g.measureText(txt).width + 10;
      const bx = Math.min(x + 2, g.canvas.width / (window.devicePixelRatio || 1) / S - tw);
      m.boxes.push({ x: bx, y: yTop, w: tw, h: 18 });
      g.fillStyle = C().ink; g.fillRect(bx, yTop, tw, 18);
      g.fillStyle = C().paper; g.textAlign = "left"; g.textBaseline = "middle";
      g.fillText(txt, bx + 5, yTop + 9.5);
      g.textAlign = "center";
    }
  }
  return out;
}

function drawAxis(g, win, y, plotW) {
  g.strokeStyle = C().rule; g.lineWidth = 1;
  g.beginPath(); g.moveTo(LABEL_W, y + 0.5); g.lineTo(LABEL_W + plotW, y + 0.5); g.stroke();
  g.fillStyle = C().soft; g.font = "11px sans-serif"; g.textAlign = "center"; g.textBaseline = "top";
  for (const tk of win.ticks()) { g.fillRect(LABEL_W + tk.x, y, 1, 4); g.fillText(tk.text, LABEL_W + tk.x, y + 5); }
  g.textAlign = "left"; g.fillText(t(win.axis === "step" ? "axis.step" : "axis.time"), 4, y + 5);
}

export const draw = { gantt: drawGantt, LABEL_W, TOP };
