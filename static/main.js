// The page's one entry module (<script type="module" src="main.js">): start-up, the one animation
// loop, and window.BS. The page's HTML may arrive after this module runs (Gradio renders it), so
// each part starts once it is there: the stage (its data-role, lecturer, student, projector or
// replay, says which parts the server sent), then the socket and the views; the what-if panel
// on its own.
import * as a11y from "./a11y.js";
import * as analysis from "./analysis.js";
import * as chartText from "./chart_text.js";
import * as controls from "./controls.js";
import * as draw from "./draw.js";
import * as i18n from "./i18n.js";
import * as interact from "./interact.js";
import * as kvmap from "./kvmap.js";
import * as layout from "./layout.js";
import * as lesson from "./lesson.js";
import * as metrics from "./metrics.js";
import * as palette from "./palette.js";
import * as record from "./record.js";
import * as room from "./room.js";
import * as socket from "./socket.js";
import { loop, state } from "./state.js";
import * as whatif from "./whatif.js";
import * as why from "./why.js";

let started = false, last = 0;

// frames and chart redraws, for the room demo and tests (demos/load/room.py reads it); idleTicks: how
// many of those frames were an idle loop's looks (below)
const perf = { frames: 0, draws: 0, drawMs: 0, maxDrawMs: 0, slowFrames: 0, idleTicks: 0 };

// An idle stage looks IDLE_TICK_MS apart instead of at every frame (60 a second): a tab left open (a
// student's, the projector's) then costs its laptop little. Idle: for IDLE_AFTER_MS no
// news came, no step was running and no replay played (a redraw of its own, such as the room's names
// or the chart's delayed shrink, needs no more frames). News (a message, a trace fed in) and the
// viewer's hand (a key, the pointer, the wheel, a resize) wake it at once.
const IDLE_AFTER_MS = 2000, IDLE_TICK_MS = 100;
let lastBusy = 0, sleeping = null;

function frame(now) {
  if (last && now - last > 1000 / 30) perf.slowFrames++;    // a frame that missed 30 fps
  last = now;
  perf.frames++;
  const news = socket.flush();
  const t0 = performance.now();
  if (interact.chartFrame(now)) {
    const ms = performance.now() - t0;
    perf.draws++; perf.drawMs += ms; perf.maxDrawMs = Math.max(perf.maxDrawMs, ms);
  }
  metrics.metricsFrame(now);
  room.roomFrame(now);
  why.whyFrame(now);
  kvmap.kvFrame(now);
  chartText.textFrame(now);     // last: its live region is paced by the time it is written
  if (news || socket.store.runningFor() != null || layout.view.mode === "replay") lastBusy = now;
  if (now - lastBusy < IDLE_AFTER_MS) requestAnimationFrame(frame);
  else sleeping = setTimeout(() => { sleeping = null; perf.idleTicks++; last = 0; requestAnimationFrame(frame); },
                             IDLE_TICK_MS);
}

function wake() {
  lastBusy = performance.now();
  if (sleeping === null) return;
  clearTimeout(sleeping);
  sleeping = null;
  last = 0;                     // the pause was not a slow frame
  requestAnimationFrame(frame);
}

function startStage() {
  const stage = document.querySelector("[data-testid=stage]");
  if (started || !stage) return false;
  started = true;
  state.role = stage.dataset.role || "lecturer";
  const lang = new URLSearchParams(location.search).get("lang");
  if (lang) i18n.setLang(lang); else i18n.applyLang(document);
  palette.drawSwatches(stage);
  interact.initChart(stage);
  if (stage.querySelector("[data-testid=controls]")) controls.initControls(stage);
  metrics.initMetrics(stage);
  chartText.initChartText(stage);
  lesson.fitChart();
  room.initRoom(stage);
  if (stage.querySelector("[data-testid=why]")) why.initWhy(stage);   // the lecturer's "why" views
  if (!state.offline) socket.connect();         // offline: a recorded stream is fed by ingestAll
  loop.wake = wake;
  for (const type of ["keydown", "pointerdown", "pointermove", "wheel", "input", "change", "focusin"]) {
    document.addEventListener(type, wake, { capture: true, passive: true });
  }
  window.addEventListener("resize", wake);
  requestAnimationFrame(frame);
  return true;
}

// run start() now, or on each change of the page until it returns true
function whenThere(start) {
  if (start()) return;
  const mo = new MutationObserver(() => { if (start()) mo.disconnect(); });
  mo.observe(document.documentElement, { childList: true, subtree: true });
}

// window.BS: the handle for the browser console, the browser tests (page.evaluate("BS.store.steps")),
// the Gradio page's event scripts (app/ui/page.py: a lesson's caption, the language) and a page that
// holds the chart in a frame (leaderboard.js). No module reads it: they import what they use. Every export of every module is on it, read live; the settings of state.js can be set
// (BS.offline = false), and so can BS.connect, which the socket's reconnect timer calls (a test swaps
// it to keep the line cut). A page may set window.BS = {offline: true} before this module runs.
function handle(preset) {
  const BS = {};
  const live = (k, get, set) => Object.defineProperty(BS, k, { get, set, enumerable: true, configurable: true });
  for (const mod of [a11y, chartText, record, i18n, palette, socket, layout, draw, interact, controls, metrics, analysis,
                     kvmap, why, room, lesson, whatif]) {
    for (const k of Object.keys(mod)) live(k, () => mod[k]);
  }
  for (const k of Object.keys(state)) {
    if (k in preset) state[k] = preset[k];
    live(k, () => state[k], (v) => { state[k] = v; });
  }
  live("connect", () => socket.line.connect, (fn) => { socket.line.connect = fn; });
  live("perf", () => perf);
  return BS;
}

window.BS = handle(window.BS || {});

const ready = (fn) => (document.readyState === "loading" ? document.addEventListener("DOMContentLoaded", fn) : fn());
ready(() => { a11y.initA11y(); whenThere(startStage); whenThere(whatif.initWhatIf); });
