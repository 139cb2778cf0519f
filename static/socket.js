// The record store and the /ws/steps connection.
// Every StepRecord and request event lands in `store`; the chart, the metrics
// and the sparklines read only from there. A dropped socket reconnects by
// itself; the snapshot sent on connect backfills the steps it missed.
import { t } from "./i18n.js";
import { rec as R } from "./record.js";   // record fields are read through record.js
import { loop, state } from "./state.js";

const MAX_STEPS = 20000;        // about 10 minutes at 30 steps/s
const MAX_BACKFILL = 2000;      // steps asked for at most after a reconnect
let needRebuild = false;        // an older step was inserted: per-request data is recomputed once per batch
let pending = false;            // messages arrived since the last flush

export const store = {
  steps: [],          // step records, ascending by .step
  reqs: new Map(),    // request id -> request summary (see newReq)
  settings: null,     // latest engine settings seen (policy event or snapshot)
  gaps: [],           // {after, before}: step indices missed between two received steps
  transfers: [],      // KV hand-overs between workers (disaggregated), oldest first: {rid, label, t0, t, ...}
  stretches: null,    // the server's per-setting metrics of the whole run (app/readers/metrics.py stretches()), or null offline
  lesson: null,       // the last lesson message: {event: started|ended|stopped, lesson, text} (app/ui/lessons.py)
  version: 0,         // bumps whenever anything changes; views redraw when it moves
  connected: false,
  listeners: [],
};

function newReq(rid, label) {
  return {
    rid, label: label == null ? rid : String(label),
    arrived: null, promptLen: null, maxTokens: null,
    first: null, end: null, endEvent: null, reason: null, outputTokens: null,
    firstStep: null, lastStep: null,
    transfer: null,   // its KV hand-over to the decode worker, if it had one (disaggregated)
    tokens: [],       // {t, step, gap, stalled}: gap since the previous token, stalled if a step left it out in between
    stalledSince: false,
  };
}

function req(rid, label) {
  let r = store.reqs.get(rid);
  if (!r) { r = newReq(rid, label); store.reqs.set(rid, r); }
  if (label != null && r.label === rid) r.label = String(label);
  return r;
}

// ---- derived per-request data from one step ----
// a token's gap is a stall when a step since the previous token listed the request in `stalled`
// (app/readers/metrics.py: the one definition; a preemption's wait is a gap, not a stall)
function account(rec) {
  const step = R.step(rec), tEnd = R.tEnd(rec);
  for (const it of R.items(rec)) {
    const r = req(R.req(it), R.label(it));
    if (r.firstStep == null) r.firstStep = step;
    r.lastStep = step;
    if (R.producesToken(it)) {
      const prev = r.tokens[r.tokens.length - 1];
      r.tokens.push({ t: tEnd, step, gap: prev ? tEnd - prev.t : null, stalled: !!prev && r.stalledSince });
      // accepted drafts arrive with it: a gap of 0 each
      for (let k = 1; k < R.tokensGiven(it); k++) r.tokens.push({ t: tEnd, step, gap: 0, stalled: false });
      r.stalledSince = false;
      if (r.first == null) r.first = tEnd;
    }
  }
  for (const rid of R.stalled(rec)) {
    const r = req(rid);
    r.stalledSince = true;
    r.lastStep = step;
  }
}

function rebuild() {
  for (const r of store.reqs.values()) {
    r.tokens = []; r.firstStep = r.lastStep = null; r.stalledSince = false;
    if (r.endEvent == null) r.first = null;
  }
  for (const rec of store.steps) account(rec);
  store.gaps = [];
  for (let i = 1; i < store.steps.length; i++) {
    const a = R.step(store.steps[i - 1]), b = R.step(store.steps[i]);
    if (b > a + 1) store.gaps.push({ after: a, before: b });
  }
}

function trim() {
  if (store.steps.length <= MAX_STEPS) return;
  store.steps.splice(0, store.steps.length - MAX_STEPS);
  const first = R.step(store.steps[0]);
  for (const [rid, r] of store.reqs) {
    if (r.end != null && (r.lastStep == null || r.lastStep < first)) store.reqs.delete(rid);
  }
  store.gaps = store.gaps.filter((g) => g.before > first);
  const t0 = R.tStart(store.steps[0]);
  store.transfers = store.transfers.filter((x) => x.t >= t0);
}

function addStep(rec) {
  const steps = store.steps;
  const last = steps.length ? R.step(steps[steps.length - 1]) : -1, step = R.step(rec);
  if (step > last) {
    if (last >= 0 && step > last + 1) store.gaps.push({ after: last, before: step });
    steps.push(rec);
    account(rec);
    return;
  }
  // an older step (backfill): insert it if it is new, then recompute what depends on order
  let lo = 0, hi = steps.length;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (R.step(steps[mid]) < step) lo = mid + 1; else hi = mid; }
  if (lo < steps.length && R.step(steps[lo]) === step) return;
  steps.splice(lo, 0, rec);
  needRebuild = true;
}

function addEvent(ev) {
  const r = req(R.evReq(ev), R.evLabel(ev)), at = R.evT(ev);
  switch (R.event(ev)) {
    case "arrived": r.arrived = at; r.promptLen = R.evPromptLen(ev); r.maxTokens = R.evMaxTokens(ev); break;
    case "first_token": r.first = at; break;
    case "finished": r.end = at; r.endEvent = "finished"; r.reason = R.finishReason(ev); r.outputTokens = R.outputTokens(ev); break;
    case "aborted": r.end = at; r.endEvent = "aborted"; r.reason = R.abortReason(ev); break;
    case "preempted": break;
    case "kv_transfer": {
      // t: the import is done; t0: the export began, `seconds` before
      const x = { rid: r.rid, label: r.label, t: at, t0: at - R.xferSeconds(ev), seconds: R.xferSeconds(ev), blocks: R.xferBlocks(ev),
                  bytes: R.xferBytes(ev), from: R.xferFrom(ev), to: R.xferTo(ev), ops: R.xferOps(ev) };
      if (!store.transfers.some((y) => y.rid === x.rid && y.t === x.t)) store.transfers.push(x);   // a snapshot may repeat it
      r.transfer = x;
      break;
    }
  }
}

// One message from the socket (or from a trace file): a record, an event, a batch of them.
export function ingest(msg) {
  if (!msg || typeof msg !== "object") return;
  switch (R.type(msg)) {
    case "step": addStep(msg); settle(); store.lastStepAt = performance.now(); break;
    case "request": addEvent(msg); break;
    case "policy": store.settings = Object.assign({}, store.settings, R.settings(msg)); break;
    case "stretches": store.stretches = msg.stretches; break;
    case "lesson": store.lesson = msg; break;
    case "snapshot": {
      if (msg.settings) store.settings = Object.assign({}, store.settings, R.settings(msg.settings));
      if (msg.stretches) store.stretches = msg.stretches;
      if (msg.lesson !== undefined) store.lesson = msg.lesson;
      const before = store.steps.length ? R.step(store.steps[store.steps.length - 1]) : null;
      const recs = msg.records || [];
      for (const m of recs) ingest(m);
      // still a hole between what we had and where the snapshot starts: ask for more, once
      const first = recs.find((m) => R.type(m) === "step");
      if (before != null && first && R.step(first) > before + 1) {
        backfill(Math.min(MAX_BACKFILL, recs.filter((m) => R.type(m) === "step").length + R.step(first) - before));
      }
      break;
    }
    case "gap": backfill(300); break;   // the server skipped records for us: fetch the recent ones again
    default: return;
  }
  trim();
  store.version++;
}

// once per animation frame (main.js): recompute what a backfill changed, then tell the listeners
export function flush() {
  if (!pending) return false;
  pending = false;
  if (needRebuild) { needRebuild = false; rebuild(); store.version++; }
  store.listeners.forEach((fn) => { try { fn(store); } catch (e) { console.error(e); } });
  return true;
}
export const onStore = (fn) => store.listeners.push(fn);

// A view's redraw pace: due() when its key moved and `ms` passed since its last draw,
// and at once while no step has been drawn yet (a replay, a page opened late).
// again() makes the next frame draw whatever the key (a setting or a trace changed).
export function pacer(ms) {
  let last = -Infinity, key = "", drewSteps = false;
  return {
    due(now, k) {
      if (k === key || (drewSteps && now - last <= ms)) return false;
      last = now; key = k; drewSteps = store.steps.length > 0;
      return true;
    },
    again() { key = ""; },
  };
}

// seconds since the newest step arrived while the engine still had requests (a step is running),
// or null: idle, offline, disconnected, or a step came in the last RUNNING_AFTER seconds
const RUNNING_AFTER = 0.7;
let openAt = -1, open = false;             // is any request in the store not ended? (cached per version)
function anyOpen() {
  if (openAt !== store.version) {
    openAt = store.version; open = false;
    for (const r of store.reqs.values()) if (r.end == null) { open = true; break; }
  }
  return open;
}
store.lastStepAt = null;
store.runningFor = function () {
  const last = store.steps[store.steps.length - 1];
  if (state.offline || !store.connected || !last || store.lastStepAt == null) return null;
  if (!((last.running || 0) + (last.waiting || 0) > 0)) return null;     // counted after the step: work is left
  if (!anyOpen()) return null;             // ...unless it has all ended since (aborted: no step follows)
  const s = (performance.now() - store.lastStepAt) / 1000;
  const pause = (store.settings && +store.settings.step_delay) || 0;   // slow motion is not a running step
  return s >= RUNNING_AFTER + pause ? s : null;
};
// a recorded stream (a trace file, a test) taken in at once, as if it had arrived live
export function ingestAll(list) { for (const m of list) ingest(m); pending = true; flush(); loop.wake(); }

export function url(path) {
  // the page may be mounted under a prefix (e.g. a reverse proxy); keep it
  const base = (document.querySelector("[data-bs-root]") || {}).dataset?.bsRoot || "";
  return base + path;
}

// ---- the socket ----
let ws = null, retry = 0, timer = null;

function setConn(ok) {
  store.connected = ok;
  document.querySelectorAll("[data-testid=conn]").forEach((el) => {
    el.dataset.state = ok ? "live" : "lost";
    el.dataset.i18n = ok ? "conn.live" : "conn.lost";      // a language switch rewrites it too
    el.textContent = t(el.dataset.i18n);
  });
}

export function connect() {
  if (ws && ws.readyState <= 1) return;
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  ws = new WebSocket(proto + "//" + location.host + url("/ws/steps"));
  ws.onopen = () => { retry = 0; setConn(true); };
  ws.onmessage = (e) => {
    let msg;
    try { msg = JSON.parse(e.data); } catch (err) { return; }
    if (Array.isArray(msg)) msg.forEach(ingest); else ingest(msg);
    pending = true;
    loop.wake();
  };
  ws.onclose = () => {
    setConn(false);
    clearTimeout(timer);
    timer = setTimeout(() => line.connect(), Math.min(5000, 300 * 2 ** retry++));
  };
  ws.onerror = () => { try { ws.close(); } catch (e) { /* already closed */ } };
}

// what the reconnect timer calls: connect, unless the console or a test swaps it (window.BS.connect)
export const line = { connect };

// The store holds every step of the run since the first one the server's numbers cover: this page
// can compute every per-setting metric itself. Otherwise (opened late, a gap, trimmed) it shows the
// server's (store.stretches), which come about once a second while steps run.
export function seenWhole() {
  const st = store.stretches;
  return !st || !st.length || (store.steps.length > 0 && !store.gaps.length && R.step(store.steps[0]) <= st[0].first_step);
}

// a page that did not see the whole run asks once more when the steps stop, so its numbers
// include the last second too (a one-step snapshot carries the latest stretches)
let settleTimer = null;
function settle() {
  if (state.offline || seenWhole()) return;
  clearTimeout(settleTimer);
  settleTimer = setTimeout(() => { if (ws && ws.readyState === 1) ws.send(JSON.stringify({ type: "snapshot", last: 1 })); }, 1500);
}

// ask the server for the last `steps` steps again (after a gap or a reconnect); at most one pending
let backfillTimer = null;
function backfill(steps) {
  if (backfillTimer) return;
  backfillTimer = setTimeout(() => {
    backfillTimer = null;
    if (ws && ws.readyState === 1) ws.send(JSON.stringify({ type: "snapshot", last: steps }));
  }, 300);
}

// tests and the lecturer's console can cut the line to show it heals
export function dropSocket() { if (ws) ws.close(); }
