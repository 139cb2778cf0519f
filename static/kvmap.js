// The KV cache map: every block a cell, rebuilt from the steps' kv_ops and kv_map (analysis.kvBlocks,
// the twin of app/readers/analysis.py kv_blocks). Held: the holder's chat colour; shared by a prefix hit: its
// ref count written on it; cached but free (evictable): a pale cell with a dot; free: an empty outline.
// Disaggregated steps come from two workers with a pool each: then one map per worker, prefill first,
// each rebuilt from its own worker's steps (so a hand-over empties cells above and fills cells below).
import { analysis } from "./analysis.js";
import { laneTitle } from "./draw.js";
import { lang, t } from "./i18n.js";
import { layout, view } from "./layout.js";
import { colorOf, colors, inkOn } from "./palette.js";
import { rec as R } from "./record.js";   // record fields are read through record.js
import { pacer, store } from "./socket.js";

// a cell and its gap: 16 px (14-px cells, room for a share count) while the map fits in MAX_H; a large
// cache's cells shrink, down to MIN_PITCH, so the map keeps to about the height of the panel beside it
const PITCH = 16, MIN_PITCH = 3, MAX_H = 320;
let box, canvas, tip, shown = null;

// the pitch for `total` blocks in rows `w` px wide
function pitchFor(total, w) {
  let p = PITCH;
  while (p > MIN_PITCH && Math.ceil(total / Math.floor(w / p)) * p > MAX_H) p--;
  return p;
}
const gapOf = (p) => (p >= 8 ? 2 : p >= 5 ? 1 : 0);
const pace = pacer(300);

const label = (rid) => { const r = store.reqs.get(rid); return r ? r.label : rid; };

// the pools to draw after step `upto`: one engine's, or each worker's; {lane, step, total, blocks}
function pools(steps, last) {
  const lanes = R.worker(last) ? layout.LANES : [null];
  return lanes.map((lane) => {
    const own = steps.filter((s) => R.worker(s) === lane && R.step(s) <= R.step(last));
    const end = own[own.length - 1];
    const sent = lane ? store.transfers.filter((x) => x.from === lane) : [];
    return end ? { lane, step: R.step(end), total: R.kvTotal(end),
                   blocks: analysis.kvBlocks(own, R.step(end), sent, R.tEnd(last)) } : null;
  }).filter(Boolean);
}

function draw() {
  const steps = store.steps, v = view;
  // a clicked column first (as the X-ray), else the cursor when paused, else the newest step
  const upto = v && v.picked != null ? v.picked : v && v.mode !== "live" && v.cursor != null ? v.cursor : null;
  const last = upto == null ? steps[steps.length - 1] : steps[steps.findLastIndex((s) => R.step(s) <= upto)];
  const head = box.querySelector("[data-role=head]");
  if (!last) { shown = null; return; }
  const dpr = window.devicePixelRatio || 1, w = Math.max(200, Math.round(canvas.getBoundingClientRect().width));
  const sections = pools(steps, last), TITLE = sections.length > 1 ? 18 : 0;
  const pitch = pitchFor(sections.reduce((n, p) => n + p.total, 0), w), cols = Math.max(1, Math.floor(w / pitch));
  let h = 0;
  for (const p of sections) { p.y0 = h + TITLE; h = p.y0 + Math.ceil(p.total / cols) * pitch + (TITLE ? 6 : 0); }
  shown = { step: R.step(last), cols, pitch, sections, total: sections[0].total, blocks: sections[0].blocks };
  box.dataset.step = R.step(last);
  const count = (p) => [...p.blocks.values()].filter((b) => b.holders.length).length + " / " + p.total + " · " +
    t("kv.cached") + " " + [...p.blocks.values()].filter((b) => b.cached).length;
  head.textContent = t("kv.step") + " " + R.step(last) + " · " +
    sections.map((p) => (p.lane ? t("lane." + p.lane) + " " : "") + count(p)).join(" · ");
  canvas.style.height = h + "px";
  if (canvas.width !== w * dpr || canvas.height !== h * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0); g.clearRect(0, 0, w, h);
  for (const p of sections) {
    if (TITLE) {
      g.font = "bold 13px sans-serif"; g.textAlign = "left"; g.textBaseline = "middle"; g.fillStyle = colors.ink;
      g.fillText(laneTitle(p.lane), 0, p.y0 - TITLE / 2);
    }
    drawPool(g, p, cols, pitch);
  }
}

// small cells (a large cache) drop what no longer fits: the share count below 12 px, the cached dot and the
// free outline below 8 px (a free cell is then a pale fill, a cached one a darker one)
function drawPool(g, p, cols, pitch) {
  const { total, blocks } = p, CELL = pitch - gapOf(pitch), small = CELL < 8;
  g.font = "bold 9px sans-serif"; g.textAlign = "center"; g.textBaseline = "middle";
  for (let b = 0; b < total; b++) {
    const x = (b % cols) * pitch, y = p.y0 + Math.floor(b / cols) * pitch, e = blocks.get(b);
    if (!e && small) { g.fillStyle = "#eeeeee"; g.fillRect(x, y, CELL, CELL); continue; }
    if (!e) { g.strokeStyle = "#c8c8c8"; g.lineWidth = 1; g.strokeRect(x + 0.5, y + 0.5, CELL - 1, CELL - 1); continue; }
    if (!e.holders.length) {               // cached but free: evictable
      g.fillStyle = small ? "#b8b8b8" : "#e4e4e4"; g.fillRect(x, y, CELL, CELL);
      if (small) continue;
      g.fillStyle = "#777"; g.beginPath(); g.arc(x + CELL / 2, y + CELL / 2, 2, 0, 2 * Math.PI); g.fill();
      continue;
    }
    const color = colorOf(label(e.holders[0]));
    g.fillStyle = color; g.fillRect(x, y, CELL, CELL);
    if (e.holders.length > 1 && CELL >= 12) {
      g.fillStyle = inkOn(color); g.fillText(String(e.holders.length), x + CELL / 2, y + CELL / 2 + 1);
    }
  }
}

function onMove(ev) {
  if (!shown) return;
  const r = canvas.getBoundingClientRect();
  const py = ev.clientY - r.top, p = [...shown.sections].reverse().find((q) => py >= q.y0);
  if (!p) { tip.hidden = true; return; }
  const col = Math.floor((ev.clientX - r.left) / shown.pitch), row = Math.floor((py - p.y0) / shown.pitch);
  const b = row * shown.cols + col;
  if (col >= shown.cols || b < 0 || b >= p.total) { tip.hidden = true; return; }
  const e = p.blocks.get(b);
  const lines = [(p.lane ? t("lane." + p.lane) + " · " : "") + t("kv.block") + " " + b];
  if (!e) lines.push(t("kv.free"));
  else {
    lines.push(t("kv.refs") + " " + e.holders.length + (e.cached ? " · " + t("kv.cached") : ""));
    if (e.holders.length) lines.push(t("kv.holders") + ": " + e.holders.map((h) => label(h) + " (" + h + ")").join(", "));
  }
  tip.textContent = lines.join(" · ");
  tip.hidden = false;
  tip.style.left = (ev.clientX - r.left + 12) + "px"; tip.style.top = (ev.clientY - r.top + 12) + "px";
}

// the map as drawn, for tests: [[block, holders, cached]], the first pool's and each lane's
const cells = (blocks) => [...blocks].map(([b, e]) => [b, e.holders, e.cached]);
export const kvMapShown = () => (shown ? { step: shown.step, cols: shown.cols, pitch: shown.pitch, blocks: cells(shown.blocks),
                                 lanes: Object.fromEntries(shown.sections.map((p) => [p.lane, cells(p.blocks)])) } : null);

export function initKvMap(stage) {
  box = stage.querySelector("[data-testid=kv-map]");
  if (!box) return;
  canvas = box.querySelector("canvas"); tip = box.querySelector("[data-role=tip]");
  canvas.addEventListener("mousemove", onMove);
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
}

// called by main.js's one animation loop; draws once initKvMap found the map
export function kvFrame(now) {
  if (!box) return;
  const v = store.version + ":" + view.mode + view.cursor + ":" + view.picked + lang();
  if (pace.due(now, v)) draw();
}
