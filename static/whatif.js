// What-if panel: replay the class's own requests under other settings (POST /api/whatif, app/replay/whatif.py).
// Presenter only: every call carries the key from this tab's sessionStorage; the server refuses otherwise.
// Draws one Gantt per run (actual first), all on one time axis that starts at the first arrival, and
// the per-user table with the change from actual to each what-if ("Dan: longest stall 4.3 s -> 0.5 s").
import { fmt, t } from "./i18n.js";
import { segments } from "./metrics.js";
import { colorOf, colors, prefillPattern, stallPattern } from "./palette.js";
import { rec as R } from "./record.js";   // record fields are read through record.js
import { store, url } from "./socket.js";
import { state } from "./state.js";

const ROW = 16, LEFT = 70;
let root, polling = null;

const $ = (id) => root.querySelector("[data-testid=" + id + "]");


function headers() {
  let key = "";
  try { key = sessionStorage.getItem("batchscope.key") || ""; } catch (e) { /* no storage */ }
  return key ? { "X-Presenter-Key": key, "Content-Type": "application/json" } : { "Content-Type": "application/json" };
}

function say(text, bad) {
  const el = $("whatif-status");
  el.textContent = text;
  el.dataset.bad = bad ? "1" : "";
}

async function call(method, path, body) {
  const r = await fetch(url(path), { method, headers: headers(), body: body ? JSON.stringify(body) : undefined,
                                      cache: "no-store" });
  const data = (r.headers.get("content-type") || "").includes("json") ? await r.json() : await r.text();
  if (!r.ok) throw new Error((data && data.error && data.error.message) || r.statusText);
  return data;
}

function showLog(log) {
  $("whatif-log").textContent = fmt("whatif.log", { n: log.requests, steps: log.steps }) + (log.full ? t("whatif.full") : "");
}

const since = () => Math.max(0, parseInt($("whatif-since").value, 10) || 0);

// before a replay starts: how long it would take for the range and settings chosen, against the limit
function showEstimate(s) {
  const e = s.estimate, n = settings().length, el = $("whatif-estimate");
  if (!e || s.running) return;
  const total = e.seconds_per_setting * Math.max(1, n), over = total > s.time_limit_s;
  el.textContent = e.requests ? fmt("whatif.estimate", { n: e.requests, step: e.since_step, s: Math.round(total),
                                                        limit: Math.round(s.time_limit_s) }) + (over ? t("whatif.too_long") : "")
    : fmt("whatif.nothing", { step: e.since_step });
  el.dataset.bad = over || !e.requests ? "1" : "";
  $("whatif-run").disabled = over || !e.requests || !n;
}

// answers may come back out of order (a slow estimate, a busy server): one older than the newest shown is dropped
let asked = 0, shown = 0;

// The log grows while the class chats and lessons play: while records have come in since the last look,
// the panel looks again every LOOK_EVERY_MS, if it is on screen in a visible tab (else it asks nothing).
const LOOK_EVERY_MS = 2000;
let onScreen = false, lookedAt = null;

function lookAgain() {
  if (!onScreen || document.hidden || !root.isConnected || store.version === lookedAt) return;
  lookedAt = store.version;
  poll();
}

async function poll() {
  const mine = ++asked;
  try {
    const s = await call("GET", "/api/whatif?since_step=" + since());
    if (mine < shown) return;
    shown = mine;
    showLog(s.log);
    showEstimate(s);
    const bar = $("whatif-progress");
    if (s.running && s.progress) {
      const p = s.progress;
      bar.hidden = false;
      bar.value = p.fraction;
      say(fmt("whatif.progress", { k: p.setting, n: p.settings, phase: p.phase, tokens: p.tokens, total: p.tokens_total }));
    }
  } catch (e) {
    if (mine >= shown) say(e.message, true);
  }
}

function settings() {
  const budget = parseInt($("whatif-budget").value, 10);
  return [...root.querySelectorAll("input[data-whatif-policy]:checked")].map((c) => {
    const s = { policy: c.dataset.whatifPolicy };
    if (budget > 0) s.max_num_batched_tokens = budget;
    return s;
  });
}

async function run() {
  const chosen = settings();
  if (!chosen.length) return say(t("whatif.tick"), true);
  $("whatif-run").disabled = true;
  $("whatif-progress").hidden = false;
  $("whatif-progress").value = 0;
  say(t("whatif.starting"));
  polling = setInterval(poll, 500);
  try {
    const result = await call("POST", "/api/whatif", { settings: chosen, since_step: since() });
    const runs = (await call("GET", "/api/whatif/result?format=json")).runs;
    draw(runs, result);
    say(fmt("whatif.done", { n: result.requests }) +
        (result.left_out_running ? fmt("whatif.left", { n: result.left_out_running }) : ""));
  } catch (e) {
    say(e.message, true);
  } finally {
    clearInterval(polling);
    $("whatif-run").disabled = false;
    $("whatif-progress").hidden = true;
    poll();
  }
}

// ---- the Gantts: one per run, rows = users in arrival order, x = seconds since the first arrival ----
function startOf(records) {
  const arrivals = records.filter((r) => r.type === "request" && r.event === "arrived").map((r) => r.t);
  const starts = records.filter((r) => r.type === "step").map((r) => R.tStart(r));
  return Math.min(...(arrivals.length ? arrivals : starts));
}

function draw(runs, result) {
  const box = $("whatif-gantts");
  box.textContent = "";
  const spans = runs.map((run) => {
    const t0 = startOf(run.records);
    const ends = run.records.filter((r) => r.type === "step").map((r) => R.tEnd(r) - t0);
    return Math.max(0.001, ...ends);
  });
  const span = Math.max(...spans);
  for (const run of runs) box.appendChild(gantt(run, span));
  table(result);
  $("whatif-downloads").hidden = false;
}

function gantt(run, span) {
  const t0 = startOf(run.records), rows = [], names = {};
  for (const r of run.records) {
    if (r.type === "request" && r.event === "arrived" && !(r.req in names)) { names[r.req] = r.label; rows.push(r.req); }
  }
  const fig = document.createElement("figure");
  fig.className = "bs-whatif-gantt";
  fig.dataset.run = run.name;
  const cap = document.createElement("figcaption");
  cap.textContent = run.name;
  const canvas = document.createElement("canvas");
  const w = Math.max(300, root.clientWidth - 20), h = rows.length * ROW + 24;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = w * dpr; canvas.height = h * dpr;
  canvas.style.width = w + "px"; canvas.style.height = h + "px";
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  const x = (sec) => LEFT + ((sec - t0) / span) * (w - LEFT - 10);
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = colors.soft;
  rows.forEach((req, i) => g.fillText(names[req], 4, i * ROW + 12));
  const rowOf = Object.fromEntries(rows.map((r, i) => [r, i]));
  for (const s of run.records) {
    if (R.type(s) !== "step") continue;
    const x0 = x(R.tStart(s)), wid = Math.max(1, x(R.tEnd(s)) - x0);
    for (const req of R.stalled(s)) {        // the same cells as the live chart: stall cross-hatch,
      if (!(req in rowOf)) continue;         // decode solid, prefill striped, in the user's colour
      g.fillStyle = stallPattern(g);
      g.fillRect(x0, rowOf[req] * ROW + 2, wid, ROW - 4);
    }
    for (const it of R.items(s)) {
      if (!(R.req(it) in rowOf)) continue;
      const color = colorOf(R.label(it));
      g.fillStyle = R.isDecode(it) ? color : prefillPattern(g, color);
      g.fillRect(x0, rowOf[R.req(it)] * ROW + 2, wid, ROW - 4);
    }
  }
  g.fillStyle = colors.muted;
  const y = rows.length * ROW + 16;
  for (let k = 0; k <= 4; k++) {
    const sec = (span * k) / 4;
    g.fillText(sec.toFixed(1) + " s", LEFT + (k / 4) * (w - LEFT - 10) - (k === 4 ? 30 : 0), y);
  }
  fig.append(cap, canvas);
  return fig;
}

// ---- the per-user table: actual, each what-if, and the change ----
function seconds(v) { return v == null ? "–" : v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s"; }

function table(result) {
  const box = $("whatif-table");
  const cols = [["ttft_s", t("whatif.ttft")], ["tbt_p99_s", t("whatif.tbt")], ["longest_stall_s", t("whatif.stall")]];
  const head = [t("whatif.user"), ...result.whatif.map((w, i) =>
    fmt("whatif.versus", { k: i + 1, policy: w.settings.policy ? t("policy." + w.settings.policy) : t("whatif.live") }))];
  const cell = (tag, lines) => {                 // text only: labels come from users
    const c = document.createElement(tag);
    lines.forEach((l, i) => { if (i) c.append(document.createElement("br")); c.append(l); });
    return c;
  };
  const top = document.createElement("tr");
  top.append(...head.map((h) => cell("th", [h])));
  const rows = [top];
  for (const u of result.actual.users) {
    const tr = document.createElement("tr");
    tr.dataset.user = u.label;
    tr.append(cell("th", [u.label]), ...result.whatif.map((w) => {
      const other = w.users.find((x) => x.label === u.label) || {};
      return cell("td", cols.map(([k, name]) => `${name} ${seconds(u[k])} -> ${seconds(other[k])}`));
    }));
    rows.push(tr);
  }
  box.replaceChildren(...rows);
  box.hidden = false;
}


// ---- downloads: fetched with the key, then saved from a blob ----
async function download(kind) {
  const path = kind === "log" ? "/api/whatif/log" : `/api/whatif/result?format=${kind}`;
  try {
    const r = await fetch(url(path), { headers: headers(), cache: "no-store" });
    if (!r.ok) throw new Error((await r.json()).error.message);
    const a = document.createElement("a");
    a.href = URL.createObjectURL(await r.blob());
    a.download = { html: "batchscope-whatif.html", chrome: "batchscope-whatif.json", log: "batchscope-arrivals.json" }[kind];
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  } catch (e) {
    say(e.message, true);
  }
}

async function clearLog() {
  try { showLog(await call("DELETE", "/api/whatif/log")); say(t("whatif.cleared")); } catch (e) { say(e.message, true); }
}

// the panel's buttons, once it is on the page (main.js calls this until it is): false while it is not
export function initWhatIf() {
  root = document.querySelector("[data-testid=whatif]");
  if (!root || root.dataset.ready) return !!root;
  root.dataset.ready = "1";
  $("whatif-run").addEventListener("click", run);
  $("whatif-clear").addEventListener("click", clearLog);
  $("whatif-since").addEventListener("change", poll);
  root.querySelectorAll("input[data-whatif-policy], [data-testid=whatif-budget]").forEach((c) => c.addEventListener("change", poll));
  // the step the last lesson pressed in this tab began at; else where the newest setting began
  $("whatif-last-lesson").addEventListener("click", () => {
    const st = store && store.stretches, segs = store && store.steps.length ? segments(store.steps.length - 1) : [];
    const step = state.lessonStart != null ? state.lessonStart : st && st.length ? st[st.length - 1].first_step
      : segs.length ? R.step(segs[segs.length - 1].first) : 0;
    $("whatif-since").value = step;
    poll();
  });
  root.querySelectorAll("[data-download]").forEach((b) => b.addEventListener("click", () => download(b.dataset.download)));
  poll();
  lookedAt = store.version;
  new IntersectionObserver((seen) => { onScreen = seen.some((e) => e.isIntersecting); lookAgain(); }).observe(root);
  setInterval(lookAgain, LOOK_EVERY_MS);
  return true;
}
