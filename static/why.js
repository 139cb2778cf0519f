// The "why" views, drawn from the record stream alone (live, paused or replayed):
//   cost-model    each step's wall time against its tokens, the fitted cost line and the budget advisor;
//                 beside it, on request, the same plot of a trace recorded on a GPU (static/data/)
//   step-xray     one step's flat ragged batch: its items, the packed tokens and the attention mask
//   stall-causes  why replies waited: gap time by cause per setting; the chart links a stall to its cause
// Numbers come from static/analysis.js (the twin of app/readers/analysis.py); records are read through record.js.
import { analysis } from "./analysis.js";
import { apply } from "./controls.js";
import { applyLang, fmt, lang, t } from "./i18n.js";
import { initKvMap } from "./kvmap.js";
import { view } from "./layout.js";
import { colorOf, prefillPattern } from "./palette.js";
import { rec as R } from "./record.js";   // record fields are read through record.js
import { pacer, store, url } from "./socket.js";

const A = analysis;
const FIT_WINDOW = 2000;                   // newest steps fitted: a live fit follows the machine as it is now
const MAX_COLUMNS = 4;
// kind of step: colour and marker shape both tell it (Okabe-Ito blue, vermillion, bluish green)
const KIND = { decode: ["#0072B2", "circle"], prefill: ["#D55E00", "square"], mixed: ["#009E73", "triangle"] };
const GPU_TRACE = "/static/batchscope/data/gpu_cost_trace.json";   // app/ui/page.py serves static/ there
let root, shown = false, picked = null;
const pace = pacer(400);
let gpu = null;                            // the recorded GPU trace once loaded: {steps, meta}, or {error}

const ms = (sec) => (sec !== 0 && Math.abs(sec) < 1e-5 ? (sec * 1e6).toFixed(2) + " µs"   // a GPU's per-token cost
  : Math.abs(sec) >= 1 ? sec.toFixed(2) + " s"                                          // a stall: 34.59 s
  : (Math.abs(sec) < 0.01 ? (sec * 1000).toFixed(2) : (sec * 1000).toFixed(1)) + " ms");
const $ = (sel) => root.querySelector(sel);

function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text != null) e.textContent = text;
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  return e;
}

// the steps a view shows: all of them live, up to the cursor when paused or replaying
function visibleSteps() {
  const steps = store.steps, v = view;
  if (!v || v.mode === "live" || v.cursor == null) return steps;
  return steps.slice(0, steps.findLastIndex((s) => R.step(s) <= v.cursor) + 1);
}

function canvas2d(c, cssH) {
  const dpr = window.devicePixelRatio || 1, w = Math.max(200, Math.round(c.getBoundingClientRect().width));
  c.style.height = cssH + "px";
  if (c.width !== w * dpr || c.height !== cssH * dpr) { c.width = w * dpr; c.height = cssH * dpr; }
  const g = c.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, cssH);
  return { g, w, h: cssH };
}

function marker(g, shape, x, y, r) {
  g.beginPath();
  if (shape === "circle") g.arc(x, y, r, 0, 2 * Math.PI);
  else if (shape === "square") g.rect(x - r, y - r, 2 * r, 2 * r);
  else { g.moveTo(x, y - r * 1.2); g.lineTo(x + r * 1.1, y + r * 0.8); g.lineTo(x - r * 1.1, y + r * 0.8); g.closePath(); }
}

// ---- step cost ----
function drawCost(steps) {
  const box = $("[data-testid=cost-model]"), c = box.querySelector("canvas");
  const last = steps[steps.length - 1];
  const device = last ? R.device(last) : "";
  const pts = last ? A.costPoints(steps, device, FIT_WINDOW) : [];
  const fit = A.fitCost(pts, device);
  const { g, w, h } = canvas2d(c, 260);
  const cap = box.querySelector("[data-role=caption]"), info = box.querySelector("[data-role=fit]");
  box.dataset.points = pts.length;
  if (!fit) {
    cap.textContent = t("cost.empty"); info.textContent = "";
    delete box.dataset.a; drawGpu(box); return;
  }
  const budget = R.budget(last), ctx = A.median(pts.map((p) => p.context));
  Object.assign(box.dataset, { device, a: fit.a, b: fit.b, c: fit.c, r2: fit.r2 == null ? "" : fit.r2, n: fit.n,
    terms: fit.terms, regime: A.regime(fit, budget), context: ctx, budget });
  cap.textContent = fmt("cost.cap." + A.regime(fit, budget), { dev: device || "?", a: ms(fit.a), b: ms(fit.b) });
  const term = (x) => (x < 0 ? " − " : " + ") + ms(Math.abs(x));    // a negative c reads "− 0.21 ms"
  info.textContent = t("cost.fit") + ": " + ms(fit.a) + term(fit.b) + " × " + t("cost.tokens") + term(fit.c) +
    " × context · R² " + (fit.r2 == null ? "–" : fit.r2.toFixed(3)) + " · n " + fit.n + " · " + device;
  plotCost(g, w, h, pts, fit, ctx, budget, adviceFor(fit, ctx), false);
  legend(box);
  drawGpu(box);
}

// one scatter with its fit line at the median context; hollow markers and a dashed line for a recorded trace
function plotCost(g, w, h, pts, fit, ctx, budget, advice, hollow) {
  const L = 52, B = 30, T = 10, Rm = 12;
  const xMax = Math.max(8, budget, advice || 0, ...pts.map((p) => p.tokens)) * 1.05;
  const yMax = Math.max(...pts.map((p) => p.seconds), A.predict(fit, xMax, ctx)) * 1.1 || 1;
  const X = (n) => L + (n / xMax) * (w - L - Rm), Y = (sec) => h - B - (sec / yMax) * (h - B - T);
  g.strokeStyle = "#999"; g.lineWidth = 1; g.beginPath(); g.moveTo(L, T); g.lineTo(L, h - B); g.lineTo(w - Rm, h - B); g.stroke();
  g.fillStyle = "#444"; g.font = "11px sans-serif"; g.textAlign = "center"; g.textBaseline = "top";
  for (let i = 0; i <= 4; i++) g.fillText(Math.round(xMax * i / 4), X(xMax * i / 4), h - B + 4);
  g.fillText(t("cost.axis.x"), (L + w) / 2, h - 13);
  g.textAlign = "right"; g.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) g.fillText((yMax * i / 4 * 1000).toFixed(0), L - 4, Y(yMax * i / 4));
  g.save(); g.translate(11, (T + h - B) / 2); g.rotate(-Math.PI / 2); g.textAlign = "center";
  g.fillText(t("cost.axis.y"), 0, 0); g.restore();
  // points: colour and shape by kind, size by context read
  const cMax = Math.max(1, ...pts.map((p) => p.context));
  g.globalAlpha = hollow ? 0.9 : 0.7; g.lineWidth = 1.5;
  for (const p of pts) {
    const [color, shape] = KIND[p.kind];
    marker(g, shape, X(p.tokens), Y(p.seconds), 2.5 + 6 * Math.sqrt(p.context / cMax));
    if (hollow) { g.strokeStyle = color; g.stroke(); } else { g.fillStyle = color; g.fill(); }
  }
  g.globalAlpha = 1;
  // the fit at the median context, the budget and the advised budget
  g.save(); g.strokeStyle = "#111"; g.lineWidth = 2; if (hollow) g.setLineDash([8, 4]); g.beginPath();
  g.moveTo(X(0), Y(A.predict(fit, 0, ctx))); g.lineTo(X(xMax), Y(A.predict(fit, xMax, ctx))); g.stroke(); g.restore();
  vline(g, w, X(budget), T, h - B, "#555", [6, 4], t("bar.budget") + " " + budget);
  if (advice) vline(g, w, X(advice), T + 14, h - B, "#CC79A7", [2, 3], "→ " + advice);
}

// ---- the recorded GPU trace, beside the live fit ----
async function loadGpu() {
  gpu = { loading: true };
  try {
    const r = await fetch(url(GPU_TRACE));
    if (!r.ok) throw new Error("HTTP " + r.status);
    loadGpuTrace(await r.json());
  } catch (e) { gpu = { error: String(e.message || e) }; }
  pace.again();
}

// a trace file's objects: its meta line, then records (offline pages and tests hand it over directly)
export function loadGpuTrace(objs) {
  const meta = objs.find((o) => o.type === "trace") || {};
  gpu = { meta, steps: objs.filter((o) => o.type === "step") };
  pace.again();
}

function drawGpu(box) {
  const on = box.querySelector("[data-testid=gpu-compare]").checked, part = box.querySelector("[data-role=gpu]");
  part.hidden = !on;
  if (!on) return;
  if (!gpu) { loadGpu(); }
  const note = part.querySelector("[data-role=gpu-note]"), cap = part.querySelector("[data-role=gpu-caption]");
  const info = part.querySelector("[data-role=gpu-fit]");
  if (!gpu || gpu.loading || gpu.error) {
    note.textContent = gpu && gpu.error ? fmt("cost.gpu.error", { msg: gpu.error }) : t("cost.gpu.loading");
    cap.textContent = info.textContent = ""; return;
  }
  const steps = gpu.steps, last = steps[steps.length - 1], device = R.device(last);
  const pts = A.costPoints(steps, device), fit = A.fitCost(pts, device);
  const m = gpu.meta;          // the trace's own budget (its meta line), which most of its steps ran under
  const budget = m.max_num_batched_tokens || R.budget(last), ctx = A.median(pts.map((p) => p.context));
  note.textContent = fmt("cost.gpu.note", { gpu: m.gpu || "?", dev: device, budget,
    model: (m.model || "").replace(/ shapes.*$/, "") || "?" });
  Object.assign(part.dataset, { device, a: fit.a, b: fit.b, c: fit.c, r2: fit.r2 == null ? "" : fit.r2, n: fit.n,
    regime: A.regime(fit, budget), budget });
  cap.textContent = fmt("cost.cap." + A.regime(fit, budget), { dev: device, a: ms(fit.a), b: ms(fit.b) });
  const term = (x) => (x < 0 ? " − " : " + ") + ms(Math.abs(x));
  info.textContent = t("cost.fit") + ": " + ms(fit.a) + term(fit.b) + " × " + t("cost.tokens") + term(fit.c) +
    " × context · R² " + (fit.r2 == null ? "–" : fit.r2.toFixed(3)) + " · n " + fit.n + " · " + device;
  const { g, w, h } = canvas2d(part.querySelector("canvas"), 220);
  plotCost(g, w, h, pts, fit, ctx, budget, null, true);
}

function vline(g, w, x, y0, y1, color, dash, label) {
  g.save(); g.setLineDash(dash); g.strokeStyle = color; g.lineWidth = 2;
  g.beginPath(); g.moveTo(x, y0); g.lineTo(x, y1); g.stroke(); g.restore();
  g.fillStyle = color; g.font = "bold 11px sans-serif"; g.textBaseline = "top";
  // the label right of its line, or left of it where it would run past the canvas's right edge (w)
  const right = g.measureText(label).width <= w - x - 4;
  g.textAlign = right ? "left" : "right";
  g.fillText(label, right ? x + 4 : x - 4, y0);
}

function legend(box) {
  const ul = box.querySelector("[data-role=legend]");
  if (ul.childElementCount) return;
  for (const kind of ["decode", "prefill", "mixed"]) {
    const c = el("canvas", null, { width: 14, height: 14 }), g = c.getContext("2d");
    g.fillStyle = KIND[kind][0]; marker(g, KIND[kind][1], 7, 7, 5); g.fill();
    const li = el("li"); li.append(c, el("span", null, { "data-i18n": "cost." + kind }));
    ul.append(li);
  }
  ul.append(el("li", null, { "data-i18n": "cost.size" }));
  applyLang(ul);
}

function adviceFor(fit, ctx) {
  const input = $("[data-testid=tbt-target]"), out = $("[data-role=advice]"), button = $("[data-testid=apply-budget]");
  if (!input.dataset.touched && fit.b > 0) {   // a default this machine can meet: 1.2x a 32-token step, to 10 ms
    input.value = Math.max(10, Math.ceil(1.2 * (fit.a + 32 * fit.b + fit.c * (ctx || 0)) * 100) * 10);
  }
  const target = parseFloat(input.value) / 1000;
  let best = null;
  if (target > 0) {
    best = A.adviseBudget(fit, target, ctx);
    out.textContent = best != null ? t("cost.advice") + ": " + best : t(fit.b <= 0 ? "cost.free" : "cost.none");
  } else out.textContent = "";
  out.dataset.budget = best == null ? "" : best;
  button.disabled = best == null;
  return best;
}

// ---- step X-ray ----
function stepToShow(steps) {
  if (picked != null) {
    const s = steps.find((x) => R.step(x) === picked);
    if (s) return s;
  }
  return steps[steps.length - 1];
}

function drawXray(steps) {
  const box = $("[data-testid=step-xray]"), s = stepToShow(steps);
  const table = box.querySelector("table"), head = box.querySelector("[data-role=head]");
  if (!s) { head.textContent = t("xray.pick"); table.replaceChildren(); return; }
  box.dataset.step = R.step(s);
  const bs = R.blockSize(s), items = R.items(s);
  head.textContent = t("xray.step") + " " + R.step(s) + " · " + R.numTokens(s) + " / " + R.budget(s) + " " + t("cost.tokens") + " · " +
    ms(R.dur(s)) + (R.stalled(s).length ? " · " + t("xray.left") + ": " + R.stalled(s).map((r) => label(r) + " (" + stallWhy(s, r) + ")").join(", ") : "");
  const tr = el("tr");
  for (const k of ["xray.req", "xray.kind", "xray.pos", "xray.ctx", "xray.blocks"]) tr.append(el("th", t(k)));
  const rows = items.map((it) => {
    const end = R.start(it) + R.tokens(it) - 1, ctx = R.start(it) + R.tokens(it), blocks = Math.ceil(ctx / bs);
    const row = el("tr", null, { "data-req": R.req(it), "data-kind": R.kind(it), "data-start": R.start(it), "data-end": end,
      "data-context": ctx, "data-blocks": blocks });
    const who = el("td"); const sw = el("span", "■ "); sw.style.color = colorOf(R.label(it));
    who.append(sw, document.createTextNode(R.label(it) + " (" + R.req(it) + ")"));
    const part = !R.isDecode(it) ? t("kind.prefill") + " " + R.tokens(it) : !R.drafted(it) ? t("kind.decode") :
      fmt("xray.drafts", { n: R.drafted(it), kept: R.accepted(it), rejected: R.drafted(it) - R.accepted(it) });
    if (R.drafted(it)) Object.assign(row.dataset, { drafted: R.drafted(it), accepted: R.accepted(it) });
    row.append(who, el("td", part),
      el("td", R.start(it) === end ? String(end) : R.start(it) + "–" + end), el("td", String(ctx)), el("td", String(blocks)));
    return row;
  });
  table.replaceChildren(el("thead"), el("tbody"));
  table.tHead.append(tr); table.tBodies[0].append(...rows);
  drawMask(box.querySelector("canvas"), items);
}

// packed tokens on top; below, one row band per item's new tokens against its keys (cached context, then
// its own tokens causally): the block-diagonal picture, drawn as one polygon per item whatever the sizes
function drawMask(c, items) {
  const { g, w, h } = canvas2d(c, 220);
  const n = items.reduce((a, it) => a + R.tokens(it), 0), keys = items.reduce((a, it) => a + R.start(it) + R.tokens(it), 0);
  if (!n) return;
  const L = 8, top = 48, W = w - 2 * L, H = h - top - 8;
  g.fillStyle = "#333"; g.font = "11px sans-serif"; g.textBaseline = "top"; g.textAlign = "left";
  g.fillText(t("xray.packed") + " (" + n + ")", L, 0);
  g.fillText(t("xray.mask") + " (" + n + " × " + keys + ")", L, top - 15);
  let q = 0, k = 0;
  g.strokeStyle = "#ccc"; g.strokeRect(L, top, W, H);
  for (const it of items) {
    const color = colorOf(R.label(it)), nt = R.tokens(it), st = R.start(it);
    const x0 = L + (q / n) * W, x1 = L + ((q + nt) / n) * W;
    g.fillStyle = R.isDecode(it) ? color : prefillPattern(g, color); g.fillRect(x0, 14, Math.max(1, x1 - x0 - 1), 12);
    // keys k .. k+st (cached context, all visible) then k+st .. k+st+nt (causal triangle)
    const y0 = top + (q / n) * H, y1 = top + ((q + nt) / n) * H;
    const kx = (j) => L + (j / keys) * W;
    g.fillStyle = color; g.globalAlpha = 0.45;
    g.fillRect(kx(k), y0, Math.max(1, kx(k + st) - kx(k)), Math.max(1, y1 - y0));
    g.globalAlpha = 0.9; g.beginPath();
    g.moveTo(kx(k + st), y0); g.lineTo(kx(k + st + 1), y0); g.lineTo(kx(k + st + nt), y1); g.lineTo(kx(k + st), y1);
    g.closePath(); g.fill(); g.globalAlpha = 1;
    q += nt; k += st + nt;
  }
}

// ---- stall causes ----
const label = (rid) => { const r = store.reqs.get(rid); return r ? r.label : rid; };

export function stallWhy(s, rid) {
  const sc = R.stallCauses(s).find((x) => R.scReq(x) === rid);
  if (!sc) return t("cause.unknown");
  if (R.scBy(sc) != null) return fmt("why.by", { by: label(R.scBy(sc)), n: R.scByTokens(sc) });
  return t("cause." + R.scCause(sc));
}

function drawStalls(steps) {
  const table = $("[data-testid=stall-causes] table");
  const cols = A.causeTime(steps).slice(-MAX_COLUMNS);
  const head = el("tr"); head.append(el("th", ""));
  for (const col of cols) {       // the setting on two lines: policy, then budget and sequence slots
    const th = el("th", t("policy." + col.policy), { "data-policy": col.policy });
    th.append(el("br"), col.budget + " tok · " + col.maxSeqs);
    head.append(th);
  }
  const body = A.CAUSES.map((cause) => {
    const tr = el("tr", null, { "data-cause": cause }); tr.append(el("th", t("cause." + cause)));
    for (const col of cols) tr.append(el("td", col.time[cause] ? ms(col.time[cause]) : "0", { "data-value": col.time[cause] }));
    return tr;
  });
  table.replaceChildren(el("thead"), el("tbody"));
  table.tHead.append(head); table.tBodies[0].append(...body);
}

export let stallLinks = [];    // the links afterGantt drew last: {step, req, by} (tests read them)

// over the chart: a line from each stall cell to the cell of the prompt that took the step
export function afterGantt(g, drawn) {
  if (!drawn || !drawn.cells) return;
  const at = new Map(drawn.cells.map((c) => [c.step + "/" + c.req, c]));
  const links = [];
  for (const c of drawn.cells) {
    if (c.kind !== "stall") continue;
    const s = store.steps.find((x) => R.step(x) === c.step);
    const sc = s && R.stallCauses(s).find((x) => R.scReq(x) === c.req);
    const by = sc && R.scBy(sc) != null ? at.get(c.step + "/" + R.scBy(sc)) : null;
    if (!by) continue;
    links.push({ step: c.step, req: c.req, by: by.req });
    const x = c.x + c.w / 2, ya = c.y + c.h / 2, yb = by.y + by.h / 2;
    g.save(); g.strokeStyle = "#000"; g.lineWidth = 1.5; g.setLineDash([3, 2]);
    g.beginPath(); g.moveTo(x, ya); g.lineTo(x, yb); g.stroke();
    g.setLineDash([]); g.fillStyle = "#000"; g.beginPath(); g.arc(x, yb, 3, 0, 2 * Math.PI); g.fill(); g.restore();
  }
  stallLinks = links;
}

function draw() {
  const steps = visibleSteps();
  drawCost(steps);
  drawXray(steps);
  drawStalls(steps);
}

export function onStepClick(s) { picked = R.step(s); pace.again(); }

export function initWhy(stage) {
  root = stage;
  initKvMap(stage);
  if (!$("[data-testid=cost-model]")) return;
  $("[data-testid=tbt-target]").addEventListener("input", (e) => { e.target.dataset.touched = "1"; pace.again(); });
  $("[data-testid=gpu-compare]").addEventListener("change", () => { pace.again(); });
  $("[data-testid=apply-budget]").addEventListener("click", () => {
    const b = parseInt($("[data-role=advice]").dataset.budget, 10);
    if (b >= 1) apply({ max_num_batched_tokens: b });
  });
  shown = true;
}

// called by main.js's one animation loop; draws once initWhy found the views
export function whyFrame(now) {
  if (!shown) return;
  const v = store.version + ":" + view.mode + view.cursor + lang() + ":" + picked;
  if (pace.due(now, v)) draw();
}
