// Live metrics per stretch of settings, and the per-session token-arrival sparklines.
// The same numbers, by the same definitions, as app/readers/metrics.py (stretches()); a
// browser test replays a recorded trace here and compares the table with Python's:
//   TTFT       = first token time - arrival
//   TBT        = gap between consecutive tokens of one request
//   stall      = a TBT during which a step listed the request in its `stalled` field
//   percentile = linear interpolation between order statistics, at (n - 1) * q / 100
//   tokens     = a verifying decode gives 1 + its accepted drafts, all at its step's end (gaps of 0)
//   acceptance = accepted / drafted tokens of the stretch's verifying decodes
//   transfer   = a KV hand-over (disaggregated) whose import ends (its event's t) within the
//                stretch's time span and after the end of the step before it (on a boundary
//                it counts in the earlier stretch): their count, p50/p99 seconds and summed bytes
//   prefix hit rate = summed `cached` / summed `prompt_len` of the prefill items that begin a
//                prompt's read (start == cached, or 0); null with none
//   preemptions = the requests the stretch's steps preempted
// A token's time is the end of the step that produced it. A stretch is a run of consecutive
// steps under one setting (policy, token budget, max sequences, chunk cap, speculative tokens, prefix caching, KV cap).
import { fmtBytes, settingWords } from "./draw.js";
import { lang, t } from "./i18n.js";
import { view } from "./layout.js";
import { colorOf } from "./palette.js";
import { rec as R } from "./record.js";   // record fields are read through record.js
import { pacer, seenWhole, store } from "./socket.js";

const MAX_SEGMENTS = 4;
let table;
const pace = pacer(500);   // at most twice a second while steps stream in

// q in [0, 100] of an ascending array; null for no data
export function percentile(sorted, q) {
  if (!sorted.length) return null;
  const pos = (sorted.length - 1) * q / 100, lo = Math.floor(pos);
  return lo === pos ? sorted[lo] : sorted[lo] + (sorted[lo + 1] - sorted[lo]) * (pos - lo);
}
const pct = percentile;

// segments (newest last) of the steps up to index `upto`, at most MAX_SEGMENTS of them
export function segments(upto) {
  const steps = store.steps;
  const segs = [];
  let end = upto;
  while (end >= 0 && segs.length < MAX_SEGMENTS) {
    let start = end;
    const k = R.settingKey(steps[end]);
    while (start > 0 && R.settingKey(steps[start - 1]) === k) start--;
    segs.unshift({ start, end, first: steps[start], last: steps[end] });
    end = start - 1;
  }
  return segs;
}

export function segmentMetrics(seg) {
  const s0 = R.step(seg.first), s1 = R.step(seg.last), steps = store.steps;
  const ttft = [], tbt = [];
  let stall = 0, tokens = 0, kv = 0, waiting = 0, busy = 0, drafted = 0, accepted = 0;
  let prompt = 0, cached = 0, preempted = 0;
  for (const r of store.reqs.values()) {
    if (!r.tokens.length || r.lastStep < s0 || r.firstStep > s1) continue;
    const t0 = r.tokens[0];
    if (t0.step >= s0 && t0.step <= s1 && r.arrived != null) ttft.push(t0.t - r.arrived);
    for (const tk of r.tokens) {
      if (tk.step < s0 || tk.step > s1) continue;
      tokens++;
      if (tk.gap != null) { tbt.push(tk.gap); if (tk.stalled) stall = Math.max(stall, tk.gap); }
    }
  }
  for (let i = seg.start; i <= seg.end; i++) {
    const s = steps[i];
    kv = Math.max(kv, R.kvFill(s));
    waiting = Math.max(waiting, R.waiting(s));
    busy += R.dur(s);
    for (const it of R.items(s)) { drafted += R.drafted(it); accepted += R.accepted(it); }
    for (const it of R.items(s)) if (R.beginsPrompt(it)) { prompt += R.promptLen(it); cached += R.cached(it) || 0; }
    preempted += R.preempted(s).length;
  }
  ttft.sort((a, b) => a - b); tbt.sort((a, b) => a - b);
  const span = R.tEnd(seg.last) - R.tStart(seg.first);
  const before = seg.start > 0 ? R.tEnd(steps[seg.start - 1]) : null;
  const xfers = store.transfers.filter((x) => x.t >= R.tStart(seg.first) && x.t <= R.tEnd(seg.last) &&
                                                 (before == null || x.t > before));
  const xsec = xfers.map((x) => x.seconds).sort((a, b) => a - b);
  return {
    policy: R.policy(seg.first), budget: R.budget(seg.first), maxSeqs: R.maxSeqs(seg.first),
    speculative: R.speculative(seg.first),
    caching: R.prefixCaching(seg.first), kvLimit: R.kvLimit(seg.first), chunkCap: R.chunkCap(seg.first),
    hitRate: prompt ? cached / prompt : null, preemptions: preempted,
    steps: seg.end - seg.start + 1, from: s0, to: s1,
    ttft50: pct(ttft, 50), ttft99: pct(ttft, 99), tbt50: pct(tbt, 50), tbt99: pct(tbt, 99),
    stall, tps: span > 0 ? tokens / span : null, tokens, kvFill: kv, waiting, busy,
    transfers: xfers.length, transfer50: pct(xsec, 50), transfer99: pct(xsec, 99),
    transferBytes: xfers.reduce((a, x) => a + x.bytes, 0),
    drafted, accepted, acceptance: drafted ? accepted / drafted : null,
  };
}

// one column of the server's table (app/readers/metrics.py stretches(), a summary, not a record: its
// keys are that function's, named once here) in the shape segmentMetrics gives
const SERVER_KEYS = {
  policy: "policy", budget: "token_budget", maxSeqs: "max_num_seqs", speculative: "speculative", steps: "num_steps", from: "first_step",
  to: "last_step", ttft50: "ttft_p50_s", ttft99: "ttft_p99_s", tbt50: "tbt_p50_s", tbt99: "tbt_p99_s",
  stall: "stall_max_s", tps: "output_tokens_per_s", tokens: "output_tokens", kvFill: "kv_used_max",
  waiting: "waiting_max", busy: "busy_s", caching: "prefix_caching", kvLimit: "max_kv_blocks", chunkCap: "max_prefill_chunk",
  hitRate: "prefix_hit_rate", preemptions: "preemptions", transfers: "transfers", transfer50: "transfer_p50_s",
  transfer99: "transfer_p99_s", transferBytes: "transfer_bytes", drafted: "draft_tokens",
  accepted: "accepted_tokens", acceptance: "acceptance_rate",
};
export function serverMetrics(x) {
  const out = { server: true };
  for (const [name, key] of Object.entries(SERVER_KEYS)) out[name] = x[key];
  return out;
}

// the columns to show: this page's own numbers when it saw the whole run (or is looking back at
// a cursor), else the server's, so a page opened late shows what one open from the start shows
export function tableMetrics() {
  const steps = store.steps, live = !view || view.mode === "live" || view.cursor == null;
  if (live && !seenWhole()) return store.stretches.slice(-MAX_SEGMENTS).map(serverMetrics);
  const upto = live ? steps.length - 1 : steps.findLastIndex((s) => R.step(s) <= view.cursor);
  return segments(Math.max(0, upto)).map(segmentMetrics);
}

const sec = (v) => (v == null ? "–" : v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s");

function cellText(m, row) {
  switch (row) {
    case "steps": return m.from + "–" + m.to + " (" + m.steps + ")";
    case "ttft": return sec(m.ttft50) + " / " + sec(m.ttft99);
    case "tbt": return sec(m.tbt50) + " / " + sec(m.tbt99);
    case "stall": return m.stall > 0 ? sec(m.stall) : "0";
    case "tps": return m.tps == null ? "–" : m.tps.toFixed(1);
    case "kv": return (m.kvFill * 100).toFixed(1) + " %";
    case "waiting": return String(m.waiting);
    case "hit": return m.hitRate == null ? "–" : (m.hitRate * 100).toFixed(1) + " %";
    case "preempt": return String(m.preemptions);
    case "transfer": return m.transfers ? m.transfers + " · " + sec(m.transfer50) + " / " + sec(m.transfer99) + " · " +
      fmtBytes(m.transferBytes) : "–";
    case "spec": return m.drafted ? (m.acceptance * 100).toFixed(1) + " % (" + m.accepted + " / " + m.drafted + ")" : "–";
  }
  return "";
}

const ROWS = ["steps", "ttft", "tbt", "stall", "tps", "kv", "waiting"];

// the unrounded numbers behind each cell (kept on the cell as data-values)
function cellValues(m, row) {
  switch (row) {
    case "steps": return [m.from, m.to, m.steps];
    case "ttft": return [m.ttft50, m.ttft99];
    case "tbt": return [m.tbt50, m.tbt99];
    case "stall": return [m.stall];
    case "tps": return [m.tps];
    case "kv": return [m.kvFill];
    case "waiting": return [m.waiting];
    case "hit": return [m.hitRate];
    case "preempt": return [m.preemptions];
    case "transfer": return [m.transfers, m.transfer50, m.transfer99, m.transferBytes];
    case "spec": return [m.acceptance, m.accepted, m.drafted];
  }
  return [];
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text != null) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function drawTable() {
  const steps = store.steps;
  if (!steps.length) {
    table.replaceChildren(el("caption", t("metrics.empty")));
    return;
  }
  const ms = tableMetrics();
  const head = el("tr");
  head.append(el("th", t("metrics.segment")));
  for (const m of ms) {
    const th = el("th", null, "bs-seg bs-seg-" + m.policy);
    th.append(el("span", t("policy." + m.policy), "bs-seg-policy"), el("span", " · " + m.budget + " " + t("metrics.tok"), "bs-seg-budget"));
    if (m.chunkCap != null) th.append(el("span", " · " + settingWords.chunkCap(m.chunkCap), "bs-seg-chunk"));
    if (m.speculative) th.append(el("span", " · " + settingWords.speculative(m.speculative), "bs-seg-spec"));
    if (!m.caching) th.append(el("span", " · " + t("metrics.no_cache"), "bs-seg-cache"));
    if (m.kvLimit != null) th.append(el("span", " · " + settingWords.kvLimit(m.kvLimit), "bs-seg-cap"));
    th.dataset.policy = m.policy;
    head.append(th);
  }
  // the lines of the later lessons only where a setting in view has something to show there: the prefix hit
  // rate where a prompt was served from the cache, preemptions where one happened, the KV hand-over where
  // workers handed over, the speculative line where a decode verified drafts (the projector has no room to spare)
  const rows = [...ROWS, ...(ms.some((m) => m.hitRate) ? ["hit"] : []), ...(ms.some((m) => m.preemptions) ? ["preempt"] : []),
    ...(ms.some((m) => m.transfers) ? ["transfer"] : []), ...(ms.some((m) => m.drafted) ? ["spec"] : [])];
  const body = rows.map((row) => {
    const tr = el("tr");
    tr.dataset.metric = row;
    tr.append(el("th", t("metrics." + row)));
    for (const m of ms) {
      const td = el("td", cellText(m, row));
      td.dataset.values = JSON.stringify(cellValues(m, row));
      if (row === "stall" && m.stall > 0.25) td.className = "bs-bad";
      tr.append(td);
    }
    return tr;
  });
  // the newest stretch stays in sight: a new column (or a table already scrolled to its end) scrolls the box to
  // its right end; a lecturer who scrolled back to an older column is left there
  const box = table.closest(".bs-metrics-scroll");
  const atEnd = !box || box.scrollLeft + box.clientWidth >= box.scrollWidth - 4, grew = ms.length > shownColumns;
  shownColumns = ms.length;
  table.replaceChildren(el("thead"), el("tbody"));
  table.tHead.append(head);
  table.tBodies[0].append(...body);
  if (box && (atEnd || grew)) box.scrollLeft = box.scrollWidth;
}
let shownColumns = 0;

// ---- sparklines: one per chat panel, the user's token arrivals over the last seconds ----
const SPARK_SEC = 20;

function drawSpark(c) {
  const user = c.dataset.spark;
  const dpr = window.devicePixelRatio || 1, r = c.getBoundingClientRect();
  const w = Math.max(60, Math.round(r.width)), h = Math.max(16, Math.round(r.height));
  if (c.width !== w * dpr) { c.width = w * dpr; c.height = h * dpr; }
  const g = c.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const steps = store.steps;
  if (!steps.length) return;
  const now = R.tEnd(steps[steps.length - 1]), t0 = now - SPARK_SEC;
  const color = colorOf(user);
  const mineEl = document.querySelector("[data-mine]");
  const only = mineEl ? new Set(mineEl.dataset.mine.split(/\s+/).filter(Boolean)) : null;
  let worst = 0;
  const pts = [];
  for (const rq of store.reqs.values()) {
    if (rq.label !== user || (only && !only.has(rq.rid))) continue;
    if (rq.end != null && rq.end < t0) continue;
    for (const tk of rq.tokens) {
      if (tk.t < t0) continue;
      pts.push(tk);
      if (tk.gap != null) worst = Math.max(worst, tk.gap);
    }
  }
  const scale = Math.max(0.3, worst);
  g.fillStyle = "#eee"; g.fillRect(0, h - 1, w, 1);
  for (const tk of pts) {
    const x = (tk.t - t0) / SPARK_SEC * w;
    const hh = tk.gap == null ? 3 : Math.max(2, Math.min(1, tk.gap / scale) * (h - 2));
    g.fillStyle = tk.stalled ? "#222" : color;
    g.fillRect(x - 1, h - hh, 2, hh);
  }
  const label = c.parentElement && c.parentElement.querySelector("[data-spark-gap]");
  if (label) label.textContent = worst ? t("spark.gap") + " " + sec(worst) : "";
}

export function initMetrics(root) {
  table = root.querySelector("[data-testid=metrics] table");
}

// called once per animation frame by main.js; redraws at most twice a second, and only on change
export function metricsFrame(now) {
  if (!table) return;
  const v = store.version + ":" + (view ? view.mode + view.cursor : "") + lang();
  if (pace.due(now, v)) {
    drawTable();
    document.querySelectorAll("canvas[data-spark]").forEach(drawSpark);
  }
}
