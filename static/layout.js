// Chart layout: which steps are on screen (the view window) and which requests get a row.
// Pure functions of store and view; drawing (draw.js) and hover (interact.js) read
// what they return. The window has one shape in both axis modes:
//   {axis, steps, last, x(s), w(s), at(px), xOfTime(t), xOfStep(n), ticks()}
// with x/w in px from the left of the plot (row labels excluded).
// Disaggregated steps (records with a `worker`) get one lane per worker, prefill on top: each lane
// is a header row then the rows of the requests that worker ran in view (see lanesOf, rowsOf).
// A vLLM server's data-parallel engines (records with a `lane`) get one lane each, the same way.
import { rec as R } from "./record.js";   // record fields are read through record.js
import { store } from "./socket.js";

const MIN_CELL = 3;                  // px per step at the widest zoom
const MIN_SPAN = 2, MAX_SPAN = 30;   // seconds shown in wall-time mode
const CROWD = 12;                    // more rows than this: group them (running, queued, finished)
const COLLAPSE_S = 8;                // a finished request keeps its row this long (seconds of engine time)

export const view = {
  mode: "live",             // live | paused | replay
  cursor: null,             // .step of the last step shown (null = the newest)
  axis: "step",             // step | time
  span: 100,                // steps in view (both axes); cells never get narrower than MIN_CELL
  windowSec: 2,             // time mode: seconds shown (follows the steps in view)
  picked: null,             // .step of the column last clicked (the X-ray and the KV map show it), or null
  drawn: null,              // what the last frame showed: {steps, rows, cells, markers, rowH, win} (hover and tests read it)
};

export const mine = new Set();        // request ids of this viewer (student page); their rows are marked "you"

function findIndex(stepNum) {      // index of the last step with .step <= stepNum
  const steps = store.steps;
  let lo = 0, hi = steps.length - 1, ans = 0;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (steps[mid].step <= stepNum) { ans = mid; lo = mid + 1; } else hi = mid - 1;
  }
  return ans;
}

function cursorIndex() {
  const steps = store.steps;
  if (!steps.length) return -1;
  if (view.mode === "live" || view.cursor == null) return steps.length - 1;
  return Math.max(0, Math.min(steps.length - 1, findIndex(view.cursor)));
}

function stepRec(stepNum) {
  const steps = store.steps, i = findIndex(stepNum);
  return steps[i] && steps[i].step === stepNum ? steps[i] : null;
}

// step axis: equal columns; the newest step at the right once the window is full
function stepWindow(ci, n, plotW) {
  const steps = store.steps, last = steps[ci];
  const cw = plotW / n, first = Math.max(steps[0].step, last.step - n + 1);   // fill from the left first
  let i = ci;
  while (i > 0 && steps[i - 1].step >= first) i--;
  const inView = steps.slice(i, ci + 1);
  const every = Math.max(1, Math.ceil(60 / cw / 5) * 5);
  return {
    axis: "step", steps: inView, last, cw,
    x: (s) => (R.step(s) - first) * cw, w: () => cw,
    xOfStep: (n) => (n - first) * cw,
    at: (px) => (px < 0 ? null : stepRec(first + Math.floor(px / cw))),
    xOfTime: (t) => { const s = inView.find((s) => R.tEnd(s) >= t); return s ? (R.step(s) - first) * cw : null; },
    ticks() {
      const out = [];
      for (let s = Math.ceil(first / every) * every; s <= last.step; s += every) out.push({ x: (s - first + 0.5) * cw, text: String(s) });
      return out;
    },
  };
}

// wall time: about the steps step mode would show, each as wide as it took; the span grows at
// once (a long stall stays in view) and shrinks slowly (no jitter)
function timeWindow(ci, n, plotW) {
  const steps = store.steps, last = steps[ci];
  const span = R.tEnd(last) - R.tStart(steps[Math.max(0, ci - n + 1)]);
  const target = Math.max(MIN_SPAN, Math.min(MAX_SPAN, span));
  view.windowSec = target > view.windowSec ? target : view.windowSec * 0.97 + target * 0.03;
  const t1 = R.tEnd(last), t0 = t1 - view.windowSec, k = plotW / view.windowSec;
  let i = ci;
  while (i > 0 && R.tEnd(steps[i - 1]) > t0) i--;
  const inView = steps.slice(i, ci + 1);
  const every = view.windowSec > 20 ? 5 : view.windowSec > 6 ? 1 : 0.5;
  const x = (s) => (R.tStart(s) - t0) * k;
  return {
    axis: "time", steps: inView, last,
    x, w: (s) => Math.max(2, (R.dur(s)) * k),
    xOfStep: (n) => { const s = stepRec(n); return s ? x(s) : null; },
    // lane: a worker's steps only (two workers run steps at the same time)
    at: (px, lane) => {
      const t = t0 + px / k;
      return px < 0 ? null : inView.find((s) => R.tStart(s) <= t && t <= R.tEnd(s) && (!lane || laneOf(s) === lane)) || null;
    },
    xOfTime: (t) => (t - t0) * k,
    ticks() {
      const out = [];
      for (let t = Math.ceil(t0 / every) * every; t <= t1; t += every) out.push({ x: (t - t0) * k, text: t.toFixed(every < 1 ? 1 : 0) + " s" });
      return out;
    },
  };
}

function windowOf(plotW) {
  const ci = cursorIndex();
  if (ci < 0) return null;
  const n = Math.max(8, Math.min(view.span, Math.floor(plotW / MIN_CELL)));
  return view.axis === "step" ? stepWindow(ci, n, plotW) : timeWindow(ci, n, plotW);
}

const ridNum = (rid) => { const m = /(\d+)$/.exec(rid); return m ? +m[1] : 0; };
const byArrival = (a, b) => (a.arrived ?? 1e18) - (b.arrived ?? 1e18) || ridNum(a.rid) - ridNum(b.rid);
const GROUPS = ["running", "queued", "finished"];

const LANES = ["prefill", "decode"], ENGINE = "engine";
const dpLane = (s) => (R.lane(s) == null ? null : "dp" + R.lane(s));     // "dp1": vLLM's engine of rank 1
// the workers' lanes when the window holds disaggregated steps, else null (one engine: no lanes);
// a window across a switch also holds the single engine's steps: they get a lane of their own, on top.
// A vLLM server's data-parallel engines: one lane per engine in view, by rank
function lanesOf(win) {
  const dp = [...new Set(win.steps.map(dpLane).filter(Boolean))];
  if (dp.length) return dp.sort((a, b) => a.slice(2) - b.slice(2));
  if (!win.steps.some((s) => R.worker(s))) return null;
  return win.steps.some((s) => !R.worker(s)) ? [ENGINE, ...LANES] : LANES;
}
const laneOf = (s) => R.worker(s) || dpLane(s) || ENGINE;     // in lanes mode: the lane a step's cells go to
// where a prompt queues: the prefill worker once the newest step is the pair's, else the one engine
// (data-parallel engines: the first lane, as vLLM's records do not say which engine a waiting request will get)
const queueLane = (win) => (R.worker(win.last) ? LANES[0] : dpLane(win.last) ? lanesOf(win)[0] : ENGINE);
// the row a request's cell goes to: the request in its worker's lane, or the request alone
const rowKey = (lane, rid) => (lane ? lane + ":" + rid : rid);

// requests seen in the window (in one lane's steps when lane is given), plus those still queued
// (queued ones belong to the first lane: a prompt waits for the prefill worker)
function requestsOf(win, lane) {
  const seen = new Map();
  const add = (rid) => { if (!seen.has(rid)) seen.set(rid, store.reqs.get(rid)); };
  for (const s of win.steps) {
    if (lane && laneOf(s) !== lane) continue;
    for (const it of R.items(s)) add(R.req(it));
    for (const rid of s.stalled || []) add(rid);
  }
  if (lane && lane !== queueLane(win)) return [...seen.values()].filter(Boolean);
  const tEnd = R.tEnd(win.last), tStart = win.steps.length ? R.tStart(win.steps[0]) : tEnd;
  for (const r of store.reqs.values()) {
    if (r.arrived != null && r.arrived <= tEnd && (r.firstStep == null || r.firstStep > win.last.step) &&
        (r.end == null || r.end >= tStart)) add(r.rid);
    else if (mine.has(r.rid) && r.arrived != null && r.arrived <= tEnd) add(r.rid);   // own rows always shown
  }
  return [...seen.values()].filter(Boolean);
}

function groupOf(r, win) {
  if (r.end != null && r.end <= R.tEnd(win.last)) return "finished";
  if (r.firstStep == null || r.firstStep > win.last.step) return "queued";
  return "running";
}

// rows: [{rid, label, mine, group}] that fit in maxRows, plus what was left out.
// Few rows: oldest first, as they arrived. A crowd (or a room view): the viewer's own rows on
// top and never left out, then running, queued, finished; finished ones collapse after COLLAPSE_S.
function rowsOf(win, maxRows, grouped) {
  const lanes = lanesOf(win);
  return lanes ? laneRowsOf(win, lanes, maxRows, grouped) : requestRowsOf(win, null, maxRows, grouped);
}

// lanes: a header row per lane ({lane, header: true}), then that lane's request rows; when they
// do not all fit, the rows are dealt out one at a time to the lane with the smallest share shown
function laneRowsOf(win, lanes, maxRows, grouped) {
  const want = lanes.map((lane) => requestsOf(win, lane).length), cap = lanes.map(() => 0);
  let room = Math.min(maxRows - lanes.length, want.reduce((a, b) => a + b, 0));
  while (room-- > 0) {
    let best = -1;
    want.forEach((w, i) => { if (cap[i] < w && (best < 0 || cap[i] / w < cap[best] / want[best])) best = i; });
    cap[best]++;
  }
  const out = { rows: [], more: 0, collapsed: 0 };
  lanes.forEach((lane, i) => {
    const got = requestRowsOf(win, lane, cap[i], grouped);
    out.rows.push({ key: "lane:" + lane, lane, header: true, rid: null, label: lane, mine: false, group: null });
    out.rows.push(...got.rows);
    out.more += got.more; out.collapsed += got.collapsed;
  });
  return out;
}

function requestRowsOf(win, lane, maxRows, grouped) {
  const reqs = requestsOf(win, lane);
  const rows = reqs.map((r) => ({ key: rowKey(lane, r.rid), lane, rid: r.rid, label: r.label, mine: mine.has(r.rid),
                                  group: groupOf(r, win), end: r.end, arrived: r.arrived }));
  let collapsed = 0;
  if (!grouped && rows.length <= CROWD && !rows.some((r) => r.mine)) {
    rows.sort(byArrival);
    const shown = rows.length > maxRows ? rows.slice(rows.length - maxRows) : rows;
    return { rows: shown, more: rows.length - shown.length, collapsed };
  }
  const kept = rows.filter((r) => r.mine || r.group !== "finished" || R.tEnd(win.last) - r.end <= COLLAPSE_S);
  collapsed = rows.length - kept.length;
  // who gets a row when they do not all fit: mine, then running, queued, the latest finished
  const rank = (r) => (r.mine ? 0 : 1 + GROUPS.indexOf(r.group));
  const priority = [...kept].sort((a, b) => rank(a) - rank(b) || (a.group === "finished" ? (b.end - a.end) : byArrival(a, b)));
  const chosen = new Set(priority.slice(0, Math.max(0, maxRows)).map((r) => r.rid));
  const shown = kept.filter((r) => chosen.has(r.rid))      // own rows on top, then by group
    .sort((a, b) => b.mine - a.mine || GROUPS.indexOf(a.group) - GROUPS.indexOf(b.group) || byArrival(a, b));
  return { rows: shown, more: kept.length - shown.length, collapsed };
}

export const layout = { windowOf, rowsOf, lanesOf, laneOf, queueLane, rowKey, stepRec, findIndex, cursorIndex, GROUPS, LANES };
