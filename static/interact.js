// Interaction with the chart: the hover tooltip, and playback (pause, step, replay, scrub,
// zoom, axis). Playback is client-side: the store keeps every record, the view only moves a
// cursor over them. chartFrame() is called once per animation frame by main.js.
import { drawBar } from "./bar.js";
import { draw, fmtMs, handoverText, laneTitle, shrinkDue } from "./draw.js";
import { fmt, onLang, t } from "./i18n.js";
import { layout, view } from "./layout.js";
import { rec as R } from "./record.js";   // record fields are read through record.js
import { store } from "./socket.js";
import { state } from "./state.js";
import { afterGantt, onStepClick, stallWhy } from "./why.js";

const REPLAY_RATE = 8;      // steps per second while replaying
let gantt, bar, tip, dirty = true, lastVersion = -1, replayAcc = 0, lastFrame = 0, sawWorkers = false, lastRunningDraw = 0;
let autoTime = false;                // the axis went to wall time by itself (followWorkers), not by the viewer

// ---- hover ----
const plotX = (canvas, ev) => (ev.clientX - canvas.getBoundingClientRect().left) / state.chartScale - draw.LABEL_W;

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
    t("tip.step") + " " + R.step(s) + " · " + t("policy." + R.policy(s)) + (R.worker(s) ? " · " + t("lane." + R.worker(s)) : "") +
      " · " + t("tip.dur") + " " + fmtMs(R.dur(s)),
    t("tip.batch") + ": " + R.numTokens(s) + " / " + R.budget(s) + " " + t("tip.tokens") + " (" + decodes + " " + t("kind.decode") +
      ", " + prefill + " " + t("kind.prefill") + ")",
    (s.stalled && s.stalled.length ? t("tip.stalls") + ": " + s.stalled.length + " · " : "") +
      t("tip.kv") + " " + R.kvUsed(s) + " / " + R.kvTotal(s) + " · " + t("tip.waiting") + " " + R.waiting(s),
  ];
}

function rowLines(s, row) {
  const it = R.items(s).find((i) => R.req(i) === row.rid);
  if (row.header) return [laneTitle(row.lane)];
  const head = row.label + " (" + row.rid + ")", req = store.reqs.get(row.rid);
  if (row.lane && req && req.transfer) return [...rowLines(s, { ...row, lane: null }), t("tip.handover") + ": " + handoverText(req.transfer)];
  if (it && R.isDecode(it) && R.drafted(it)) return [head + ": " + t("kind.decode") + ", " + t("tip.position") + " " + R.start(it),
    fmt("tip.drafts", { n: R.drafted(it), kept: R.accepted(it), rejected: R.drafted(it) - R.accepted(it), got: R.tokensGiven(it) })];
  if (it && R.isDecode(it)) return [head + ": " + t("kind.decode") + ", " + t("tip.one") + ", " + t("tip.position") + " " + R.start(it)];
  if (it) {
    let l = head + ": " + t("kind.prefill") + " " + R.tokens(it) + " " + t("tip.tokens") + ", " + R.start(it) + "–" +
      (R.start(it) + R.tokens(it) - 1) + " " + t("tip.of") + " " + R.promptLen(it);
    if (R.cached(it)) l += " (" + R.cached(it) + " " + t("tip.cached") + ")";
    return [l, head + ": " + (R.completesPrompt(it) ? t("tip.first") : "…")];
  }
  if (R.stalled(s).includes(row.rid)) return [head + ": " + t("tip.stalled") + " (" + fmtMs(R.dur(s)) + ")" +
    " · " + stallWhy(s, row.rid)];
  return [head];
}

function onGanttMove(ev) {
  const d = view.drawn;
  if (!d || !d.win) return showTip(ev, null);
  const py = (ev.clientY - gantt.getBoundingClientRect().top) / state.chartScale;
  const row = d.rows[Math.floor((py - draw.TOP) / d.rowH)];
  const s = d.win.at(plotX(gantt, ev), row && row.lane);     // in a worker's lane: that worker's step
  if (!s) return showTip(ev, null);
  showTip(ev, row ? [...rowLines(s, row), ...stepLines(s)] : stepLines(s));
}

function onBarMove(ev) {
  const d = view.drawn, s = d && d.win ? d.win.at(plotX(bar, ev)) : null;
  showTip(ev, s ? stepLines(s) : null);
}

// ---- playback ----
function setMode(mode) {
  const steps = store.steps;
  if (mode !== "live" && view.mode === "live") view.cursor = steps.length ? steps[steps.length - 1].step : null;
  view.mode = mode;
  dirty = true;
  updatePlayUI();
}

export const play = {
  pause() { setMode("paused"); },
  resume() { setMode("live"); },
  step(delta) {
    const steps = store.steps;
    if (!steps.length) return;
    setMode("paused");
    const i = Math.max(0, Math.min(steps.length - 1, layout.cursorIndex() + (delta || 1)));
    view.cursor = steps[i].step;
  },
  replay() {
    const steps = store.steps;
    if (!steps.length) return;
    const shown = view.drawn && view.drawn.steps.length ? view.drawn.steps[0] : steps[0].step;
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
  const steps = store.steps, i = layout.cursorIndex() + n;
  if (i >= steps.length - 1) { view.mode = "live"; view.cursor = null; }
  else view.cursor = steps[i].step;
  dirty = true;
}

function updatePlayUI() {
  const steps = store.steps, ci = layout.cursorIndex();
  const el = document.querySelector("[data-testid=play-state]");
  if (el) {
    const at = ci >= 0 ? " · " + t("play.at") + " " + steps[ci].step : "";
    el.textContent = t("play." + (view.mode === "live" ? "live" : view.mode === "replay" ? "replaying" : "paused")) + at;
    el.dataset.mode = view.mode;
  }
  const scrub = document.querySelector("[data-testid=scrub]");
  if (scrub && steps.length) {
    scrub.min = steps[0].step; scrub.max = steps[steps.length - 1].step;
    if (document.activeElement !== scrub) scrub.value = ci >= 0 ? steps[ci].step : 0;
  }
}

// A live chart draws news at most as often as the device affords: the next draw waits until DRAW_SHARE times
// the last draw's time has passed since it started, so drawing keeps to about a tenth of the page's time. A
// laptop (a few ms a draw) still draws every step at 20-30 steps a second; a phone whose draw takes 10 ms draws
// ten times a second, and its reply's text keeps flowing. What the viewer does (a key, zoom, the axis, a
// replay) draws at once.
const DRAW_SHARE = 10;
let lastDrawAt = -Infinity, lastDrawMs = 0;       // when the last draw started (the frame's time) and its ms

// one animation frame: returns true when the chart was redrawn
export function chartFrame(now) {
  const dt = lastFrame ? (now - lastFrame) / 1000 : 0;
  lastFrame = now;
  tickReplay(dt);
  const v = store.version;
  if (v !== lastVersion) followWorkers();
  const due = now - lastDrawAt >= DRAW_SHARE * lastDrawMs;    // a live draw's turn has come
  if (view.mode === "live" && store.runningFor() != null && now - lastRunningDraw > 100 && due) {  // the clock ticks
    lastRunningDraw = now; dirty = true;
  }
  if (shrinkDue(now)) dirty = true;          // the chart has wanted a smaller size for long enough
  if ((view.mode === "live" && v !== lastVersion && due) || dirty) {
    lastVersion = v; dirty = false;
    if (gantt.isConnected) {
      const t0 = performance.now();
      drawBar(bar, draw.gantt(gantt));
      afterGantt(gantt.getContext("2d"), view.drawn);   // the why views draw over the chart
      lastDrawAt = now; lastDrawMs = performance.now() - t0;
    }
    updatePlayUI();
    return true;
  }
  // paused: the chart holds still, the scrubber grows (live news not yet drawn waits for its draw)
  if (v !== lastVersion && view.mode !== "live") { lastVersion = v; updatePlayUI(); }
  return false;
}

// the first disaggregated steps switch the x axis to wall time, once: two workers run steps at
// the same time, and only a time axis shows their lanes side by side (the radio switches back)
// and back to step index once the newest step is one engine's again, unless the viewer chose the axis
function followWorkers() {
  const steps = store.steps;
  if (!steps.length) return;
  const workers = !!R.worker(steps[steps.length - 1]);
  if (workers === sawWorkers) return;
  sawWorkers = workers;
  if (workers && view.axis !== "time") { autoTime = true; showAxis("time"); }
  else if (!workers && autoTime) { autoTime = false; showAxis("step"); }
}

function showAxis(axis) {
  play.setAxis(axis);
  document.querySelectorAll("input[name=bs-axis]").forEach((r) => { r.checked = r.value === axis; });
}

export const redrawChart = () => { dirty = true; };

// Enter on the focused chart: the step at the cursor (paused) or the newest (live) picked, as a click on its column
function pickShown() {
  const steps = store.steps, s = view.mode === "live" ? steps[steps.length - 1] : steps[layout.cursorIndex()];
  if (!s) return;
  view.picked = R.step(s);
  onStepClick(s);
  dirty = true;
}

export function initChart(root) {
  gantt = root.querySelector("[data-testid=gantt]");
  bar = root.querySelector("[data-testid=batch-bar]");
  tip = root.querySelector("[data-testid=tooltip]");
  gantt.addEventListener("mousemove", onGanttMove);
  bar.addEventListener("mousemove", onBarMove);
  for (const c of [gantt, bar]) c.addEventListener("mouseleave", () => { tip.hidden = true; });
  for (const c of [gantt, bar]) c.addEventListener("click", (ev) => {     // a column picked: views that show one step
    const d = view.drawn, s = d && d.win ? d.win.at(plotX(c, ev)) : null;
    if (s) view.picked = R.step(s);        // the step the views that show one step follow (X-ray, KV map)
    if (s) onStepClick(s);
  });
  const on = (id, fn) => { const b = root.querySelector("[data-testid=" + id + "]"); if (b) b.addEventListener("click", fn); };
  on("pause", () => play.pause());
  on("resume", () => play.resume());
  on("step", () => play.step(1));
  on("step-back", () => play.step(-1));
  on("replay", () => play.replay());
  root.querySelectorAll("input[name=bs-axis]").forEach((r) =>
    r.addEventListener("change", () => { if (r.checked) { autoTime = false; play.setAxis(r.value); } }));
  const zoom = root.querySelector("[data-testid=zoom]");
  if (zoom) zoom.addEventListener("input", () => play.zoom(+zoom.value));
  const scrub = root.querySelector("[data-testid=scrub]");
  if (scrub) scrub.addEventListener("input", () => play.seek(+scrub.value));
  document.addEventListener("keydown", (e) => {
    if (/^(INPUT|TEXTAREA|SELECT|BUTTON)$/.test(e.target.tagName) || e.target.isContentEditable) return;
    if (e.key === " ") { e.preventDefault(); view.mode === "live" ? play.pause() : play.resume(); }
    else if (e.key === "ArrowRight") play.step(1);
    else if (e.key === "ArrowLeft") play.step(-1);
    else if (e.key === "Enter" && e.target === gantt) pickShown();   // the keyboard's click on a column
  });
  window.addEventListener("resize", () => { dirty = true; });
  onLang(() => { dirty = true; });
}
