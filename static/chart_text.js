// The chart as text (WCAG 1.1.1, 4.1.3): a table of the last steps in view (step, duration, each request's
// part in it), visually hidden until "Show as table" opens it for everyone, and a polite live region that says
// what the newest step did, at most once a second. Its numbers are the chart's: the step records through
// record.js, durations by draw.js fmtMs, a stalled request's wait as the stalled step's duration (the
// number its cross-hatched cell shows).
import { fmtMs, settingChangeAt } from "./draw.js";
import { fmt, onLang, t } from "./i18n.js";
import { view } from "./layout.js";
import { rec as R } from "./record.js";
import { store } from "./socket.js";

export const TABLE_STEPS = 12;     // the table's rows: the newest steps in view
export const SAY_EVERY_MS = 1000;  // the live region speaks at most this often
let root = null, lastTable = "", lastTableAt = -Infinity, lastSaid = -1, lastSayAt = -Infinity;

const labelOf = (rid) => { const q = store.reqs.get(rid); return q ? q.label : rid; };

// one step in words: "step 412: Doc's prompt chunk of 128 tokens beside 3 replies; Alice waited 1.2 s"
// (a prompt read in one step is "Doc's whole prompt of 1514 tokens"); a step that starts a new setting
// says first what changed, as the chart's flag does: "step 96: new setting, budget 128; 4 replies"
export function describeStep(s) {
  const items = R.items(s), decodes = items.filter(R.isDecode).length;
  const chunks = items.filter((it) => !R.isDecode(it))
    .map((it) => fmt(R.start(it) === 0 && R.completesPrompt(it) ? "text.prompt" : "text.chunk",
                     { who: R.label(it), n: R.tokens(it) })).join(", ");
  let what = chunks && decodes ? fmt(decodes === 1 ? "text.beside_one" : "text.beside", { what: chunks, n: decodes })
    : chunks || fmt(decodes === 1 ? "text.reply" : "text.replies", { n: decodes });
  const change = settingChangeAt(s);
  if (change) what = fmt("text.setting", { what: change }) + "; " + what;
  const stalled = R.stalled(s).map(labelOf);
  if (stalled.length) what = fmt("text.waited", { what, who: stalled.join(", "), t: fmtMs(R.dur(s)) });
  return fmt("text.step", { step: R.step(s), what });
}

// a request's part in one step, as its cell in the chart reads
function partOf(s, rid) {
  const it = R.items(s).find((x) => R.req(x) === rid);
  if (it) return R.isDecode(it) ? t("text.decode") : fmt("text.prefill", { n: R.tokens(it) });
  return R.stalled(s).includes(rid) ? t("text.stalled") : "";
}

// the last steps in view: {steps, reqs: [[rid, header]], cells: [[part per req]]}
export function tableOf(steps) {
  const last = steps.slice(-TABLE_STEPS), reqs = [];
  for (const s of last) {
    for (const rid of [...R.items(s).map(R.req), ...R.stalled(s)]) if (!reqs.includes(rid)) reqs.push(rid);
  }
  const names = reqs.map(labelOf), twice = (n) => names.filter((x) => x === n).length > 1;
  return { steps: last, reqs: reqs.map((rid, i) => [rid, twice(names[i]) ? `${names[i]} (${rid})` : names[i]]),
           cells: last.map((s) => reqs.map((rid) => partOf(s, rid))) };
}

function cell(tag, text, attrs) {
  const e = document.createElement(tag);
  e.textContent = text;
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function renderTable() {
  const table = root.querySelector("[data-testid=chart-table]");
  const steps = view.drawn && view.drawn.win ? view.drawn.win.steps : store.steps;   // what the chart shows
  const tab = tableOf(steps);
  const key = JSON.stringify([tab.reqs, tab.cells, tab.steps.map(R.step), t("text.step_col")]);
  if (key === lastTable) return;
  lastTable = key;
  const head = cell("tr", "");
  head.append(cell("th", t("text.step_col"), { scope: "col" }), cell("th", t("text.dur_col"), { scope: "col" }),
              ...tab.reqs.map(([rid, name]) => cell("th", name, { scope: "col", "data-req": rid })));
  const rows = tab.steps.map((s, i) => {
    const tr = cell("tr", "", { "data-step": R.step(s) });
    const change = settingChangeAt(s);
    const head = change ? `${R.step(s)} (${fmt("text.setting", { what: change })})` : String(R.step(s));
    tr.append(cell("th", head, { scope: "row" }), cell("td", fmtMs(R.dur(s))),
              ...tab.cells[i].map((part) => cell("td", part)));
    return tr;
  });
  table.replaceChildren(cell("caption", fmt("text.caption", { n: tab.steps.length })),
                        cell("thead", ""), cell("tbody", ""));
  table.tHead.append(head);
  table.tBodies[0].append(...rows);
}

// the newest step, if the live region has not said it and has been quiet for SAY_EVERY_MS (null otherwise)
function toSay() {
  const steps = store.steps, s = steps[steps.length - 1];
  if (!s || view.mode !== "live" || R.step(s) === lastSaid || performance.now() - lastSayAt < SAY_EVERY_MS) return null;
  return s;
}

// The table follows the chart; the live region is written last in the frame (main.js calls this after the
// other panels) and paced by the clock at the moment of writing, not the frame's start: a slow frame
// before it (a first Plotly draw) must not bring two announcements closer than SAY_EVERY_MS.
export function textFrame(now) {
  if (!root || !root.isConnected) return;
  const s = toSay();
  const shown = !root.querySelector("[data-testid=chart-table-box]").classList.contains("bs-sr");
  if (s || shown || now - lastTableAt >= SAY_EVERY_MS) { lastTableAt = now; renderTable(); }   // shown: as the chart moves
  if (!s) return;
  lastSaid = R.step(s); lastSayAt = performance.now();
  root.querySelector("[data-testid=chart-live]").textContent = describeStep(s);
}

export function showTable(open) {
  const box = root.querySelector("[data-testid=chart-table-box]"), btn = root.querySelector("[data-testid=table-toggle]");
  box.classList.toggle("bs-sr", !open);
  btn.setAttribute("aria-expanded", String(open));
  btn.textContent = t(open ? "text.hide" : "text.show");
  lastTable = "";
  renderTable();
}

export function initChartText(stage) {
  root = stage;
  const btn = root.querySelector("[data-testid=table-toggle]");
  if (!btn) { root = null; return; }
  btn.addEventListener("click", () => showTable(btn.getAttribute("aria-expanded") !== "true"));
  onLang(() => showTable(btn.getAttribute("aria-expanded") === "true"));
  renderTable();
}
