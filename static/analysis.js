// Step cost and stall causes from the record stream: the twin of app/readers/analysis.py,
// by the same definitions (read them there). A browser test replays a recorded trace
// here and compares every number with Python's.
//   fit        time ~ a + b*tokens + c*context per device/dtype, least squares; terms dropped
//              when a pivot is under 1e-9 of its column's scale; context = sum(start + tokens)
//   regime     "flat" when b * budget < a, else "proportional"
//   advice     floor((target - a - c * context) / b), at the median context of the fitted steps
//   gap parts  each step inside a reply's gap, with its cause (the step's stall_causes entry,
//              "preempted" from a preemption to the next token, "unknown" without a record)
import { rec as R } from "./record.js";   // record fields are read through record.js

const PIVOT_EPS = 1e-9;
const CAUSES = ["prefill", "static_batch", "budget", "no_slot", "kv_full", "policy", "preempted", "unknown"];

const contextRead = (s) => R.items(s).reduce((a, it) => a + R.start(it) + R.tokens(it), 0);

function stepKind(s) {
  const kinds = new Set(R.items(s).map((it) => R.kind(it)));
  return kinds.size > 1 ? "mixed" : [...kinds][0];
}

// steps: ascending step records
function costPoints(steps, device, last) {
  const pts = [];
  for (const s of steps) {
    if (!R.items(s).length || R.failed(s) || (device != null && R.device(s) !== device)) continue;
    pts.push({ step: R.step(s), seconds: R.dur(s), tokens: R.numTokens(s), context: contextRead(s), kind: stepKind(s) });
  }
  return last ? pts.slice(-last) : pts;
}

function devices(steps) {
  const out = [];
  for (const s of steps) if (R.items(s).length && !out.includes(R.device(s))) out.push(R.device(s));
  return out;
}

function solve(m, v) {
  const n = v.length;
  m = m.map((row, i) => row.concat([v[i]]));
  const scale = [];
  for (let c = 0; c < n; c++) scale.push(Math.max(...m.map((row) => Math.abs(row[c]))) || 1);
  for (let col = 0; col < n; col++) {
    let p = col;
    for (let r = col + 1; r < n; r++) if (Math.abs(m[r][col]) > Math.abs(m[p][col])) p = r;
    if (Math.abs(m[p][col]) <= PIVOT_EPS * scale[col]) return null;
    [m[col], m[p]] = [m[p], m[col]];
    for (let r = col + 1; r < n; r++) {
      const f = m[r][col] / m[col][col];
      for (let c = col; c <= n; c++) m[r][c] -= f * m[col][c];
    }
  }
  const x = new Array(n).fill(0);
  for (let r = n - 1; r >= 0; r--) {
    let acc = 0;
    for (let c = r + 1; c < n; c++) acc += m[r][c] * x[c];
    x[r] = (m[r][n] - acc) / m[r][r];
  }
  return x;
}

function fitCost(pts, device) {
  if (!pts.length) return null;
  const ys = pts.map((p) => p.seconds);
  // every term first; then without context, then without tokens, then the mean (as app/readers/analysis.py)
  let sol = null, cols = null;
  for (cols of [[0, 1, 2], [0, 1], [0, 2], [0]]) {
    if (pts.length < cols.length) continue;
    const n = cols.length;
    const xs = pts.map((p) => cols.map((i) => [1, p.tokens, p.context][i]));
    const ata = [], aty = [];
    for (let i = 0; i < n; i++) {
      ata.push([]);
      for (let j = 0; j < n; j++) { let acc = 0; for (const x of xs) acc += x[i] * x[j]; ata[i].push(acc); }
      let acc = 0; xs.forEach((x, k) => { acc += x[i] * ys[k]; }); aty.push(acc);
    }
    sol = solve(ata, aty);
    if (sol) break;
  }
  const coef = [0, 0, 0];
  cols.forEach((i, k) => { coef[i] = sol[k]; });
  const terms = cols.length;
  let sum = 0, sq = 0;
  for (const y of ys) { sum += y; sq += y * y; }
  const mean = sum / ys.length;
  let ssTot = 0, ssRes = 0;
  pts.forEach((p, k) => {
    ssTot += (ys[k] - mean) ** 2;
    ssRes += (ys[k] - (coef[0] + coef[1] * p.tokens + coef[2] * p.context)) ** 2;
  });
  return { device: device || "", a: coef[0], b: coef[1], c: coef[2],
    r2: ssTot > 1e-20 * sq ? 1 - ssRes / ssTot : null, n: pts.length, terms };
}

const predict = (f, tokens, context) => f.a + f.b * tokens + f.c * context;

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  if (!s.length) return null;
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

const regime = (f, budget) => (f.b * budget < f.a ? "flat" : "proportional");

function adviseBudget(f, targetS, context) {
  if (!(targetS > 0)) throw new Error("target time between tokens must be a positive number of seconds");
  if (f.b <= 0) return null;
  const budget = Math.floor((targetS - f.a - f.c * context) / f.b);
  return budget >= 1 ? budget : null;
}

// gaps of every reply spanning at least one step: {req, after, step, seconds, parts: [{step, seconds, cause, by, byTokens}]}
function gapCauses(steps) {
  const out = [], last = new Map(), parts = new Map(), outOfCache = new Set();
  for (const s of steps) {
    const dur = R.dur(s), step = R.step(s);
    const got = new Set(R.items(s).filter((it) => R.producesToken(it)).map((it) => R.req(it)));
    const causes = new Map(R.stallCauses(s).map((sc) => [R.scReq(sc), sc]));
    const stalled = new Set(R.stalled(s));
    for (const r of R.preempted(s)) if (last.has(r)) outOfCache.add(r);
    for (const req of last.keys()) {
      if (got.has(req)) continue;
      if (outOfCache.has(req)) parts.get(req).push({ step, seconds: dur, cause: "preempted", by: null, byTokens: null });
      else if (stalled.has(req)) {
        const sc = causes.get(req);
        parts.get(req).push({ step, seconds: dur, cause: sc ? R.scCause(sc) : "unknown",
          by: sc && R.scBy(sc) != null ? R.scBy(sc) : null, byTokens: sc && R.scByTokens(sc) != null ? R.scByTokens(sc) : null });
      }
    }
    for (const req of got) {
      if (last.has(req) && parts.get(req).length)
        out.push({ req, after: last.get(req).step, step, seconds: R.tEnd(s) - last.get(req).t, parts: parts.get(req) });
      last.set(req, { step, t: R.tEnd(s) });
      parts.set(req, []);
      outOfCache.delete(req);
    }
    for (const req of R.finished(s)) { last.delete(req); parts.delete(req); }
  }
  return out;
}

function gapCause(g) {
  const total = new Map();
  for (const p of g.parts) total.set(p.cause, (total.get(p.cause) || 0) + p.seconds);
  let best = null;
  for (const [c, v] of total) if (best === null || v > total.get(best)) best = c;
  return best;
}

// per stretch of settings: [{first, last, policy, budget, maxSeqs, time: {cause: seconds}}]
function causeTime(steps) {
  const out = [];
  steps.forEach((s, i) => {
    if (i && R.settingKey(steps[i - 1]) === R.settingKey(s)) out[out.length - 1].last = R.step(s);
    else {
      const time = {};
      for (const c of CAUSES) time[c] = 0;
      out.push({ first: R.step(s), last: R.step(s), policy: R.policy(s), budget: R.budget(s), maxSeqs: R.maxSeqs(s), time });
    }
  });
  for (const g of gapCauses(steps))
    for (const p of g.parts) {
      const k = out.findIndex((o) => o.first <= p.step && p.step <= o.last);
      out[k].time[p.cause] += p.seconds;
    }
  return out;
}

// the KV map after step `upto` (default: the last): block id -> {holders (sorted), cached}, as app/readers/analysis.py
// steps: one engine's (or one worker's); handovers (disaggregated): that worker's sent hand-overs
// {t0, ops}, their frees applied at t0, up to time `until` (app/readers/analysis.py kv_blocks, with worker)
function kvBlocks(steps, upto, handovers = [], until = -Infinity) {
  let state = new Map();
  const apply = (ops) => {
    for (const op of ops) {
      const b = R.opBlock(op), req = R.opReq(op), cur = state.get(b);
      switch (R.opKind(op)) {
        case "alloc": state.set(b, { holders: new Set([req]), cached: false }); break;
        case "share": if (cur) cur.holders.add(req); else state.set(b, { holders: new Set([req]), cached: true }); break;
        case "free": if (cur) cur.holders.delete(req); break;
        case "commit": if (cur) cur.cached = true; else state.set(b, { holders: new Set([req]), cached: true }); break;
      }
    }
  };
  const pending = handovers.filter((h) => h.ops.length).sort((a, b) => a.t0 - b.t0);
  for (const s of steps) {
    if (upto != null && R.step(s) > upto) break;
    while (pending.length && pending[0].t0 < R.tStart(s)) apply(pending.shift().ops);
    apply(R.kvOps(s));
    const map = R.kvMap(s);
    if (map) state = new Map(map.map((e) => [R.mapBlock(e), { holders: new Set(R.mapHolders(e)), cached: R.mapCached(e) }]));
  }
  for (const h of pending) if (h.t0 <= until) apply(h.ops);
  const out = new Map();
  for (const b of [...state.keys()].sort((x, y) => x - y)) {
    const e = state.get(b);
    if (e.holders.size || e.cached) out.set(b, { holders: [...e.holders].sort(), cached: e.cached });
  }
  return out;
}

export const analysis = { CAUSES, contextRead, stepKind, costPoints, devices, solve, fitCost, predict, median, regime,
  adviseBudget, gapCauses, gapCause, causeTime, kvBlocks };
