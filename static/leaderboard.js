// The arena leaderboard (app/ui/leaderboard.py): a report JSON picked by the presenter, read in this browser,
// ranked per workload; "replay" reloads the chart frame and feeds it the winner's records, as a trace (through
// the frame's window.BS: the chart is another page, with its own modules).
import { setLang, t } from "./i18n.js";

const $ = (id) => document.querySelector(`[data-testid=${id}]`);
const lang = setLang(new URLSearchParams(location.search).get("lang") === "zh" ? "zh" : "en");
const w = (key) => t("lb." + key);
const COLS = [["goodput", 100, "%"], ["ttft_met", 100, "%"], ["tbt_met", 100, "%"],
  ["output_tokens_per_s", 1, ""], ["stall_max_s", 1000, ""]];
let doc = null;

function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text != null) e.textContent = text;
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function fmt(v, scale, unit) {
  if (v == null) return "–";
  const x = v * scale;
  return (Math.abs(x) >= 10 || Number.isInteger(x) ? x.toFixed(0) : x.toFixed(2)) + unit;
}

function status(text, bad) {
  const s = $("lb-status");
  s.textContent = text;
  s.dataset.state = bad ? "error" : "ok";
}

function render() {
  const box = $("lb-tables");
  box.textContent = "";
  for (const [name, wl] of Object.entries(doc.workloads)) {
    const byName = new Map(wl.results.map((r) => [r.policy, r]));
    box.append(el("h3", `${name}: ${wl.requests} ${w("requests")}`));
    box.append(el("p", wl.description, { class: "bs-lb-note" }));
    const table = el("table", null, { "data-workload": name, class: "bs-lb-table" });
    const head = el("tr");
    ["#", w("policy"), ...COLS.map((c) => w(c[0])), ""].forEach((h) => head.append(el("th", h)));
    table.append(head);
    wl.ranking.forEach((policy, i) => {
      const r = byName.get(policy), part = r && (r.real || r.sim);
      const tr = el("tr", null, { "data-policy": policy });
      tr.append(el("td", String(i + 1)), el("td", policy));
      if (r.error || !part) tr.append(el("td", r.error || w("norun"), { colspan: String(COLS.length), class: "bs-lb-error" }));
      else COLS.forEach(([k, scale, unit]) => tr.append(el("td", fmt(part.score[k], scale, unit))));
      const cell = el("td");
      if (i === 0 && part && !r.error) {
        const b = el("button", w("replay"), { type: "button", "data-testid": "lb-replay", "data-workload": name });
        b.addEventListener("click", () => replay(name, r));
        cell.append(b);
      }
      tr.append(cell);
      table.append(tr);
    });
    box.append(table);
  }
}

function replay(name, result) {
  const part = result.real || result.sim, frame = $("lb-chart");
  frame.hidden = false;
  frame.dataset.replayed = "";
  frame.onload = () => {
    frame.contentWindow.BS.ingestAll(part.stream);
    frame.dataset.replayed = name;
    status(`${w("replaying")} ${result.policy} ${w("on")} ${name} (${w(result.real ? "real" : "sim")})`);
  };
  frame.src = frame.dataset.src + "?lang=" + lang + "&run=" + encodeURIComponent(name) + "&t=" + Date.now();   // a fresh chart each time
}

function open(file) {
  file.text().then((text) => {
    let d;
    try { d = JSON.parse(text); } catch (e) { return status(`${file.name} ${w("notjson")}: ${e.message}`, true); }
    if (!d || d.type !== "arena_report" || !d.workloads) {
      return status(`${file.name} ${w("notreport")}`, true);
    }
    doc = d;
    render();
    status(`${file.name}: ${Object.keys(d.workloads).length} ${w("workloads")}, ${w("mode")} ${d.mode}`);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.documentElement.lang = lang;
  document.querySelectorAll("[data-lb]").forEach((e) => { e.textContent = w(e.dataset.lb); });
  $("lb-file").addEventListener("change", (e) => e.target.files[0] && open(e.target.files[0]));
});
