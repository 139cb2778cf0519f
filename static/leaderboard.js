// The arena leaderboard (app/ui/leaderboard.py): a report JSON picked by the presenter, read in this browser,
// ranked per workload; "replay" reloads the chart frame and feeds it the winner's records, as a trace.
(function () {
  const $ = (id) => document.querySelector(`[data-testid=${id}]`);
  const WORDS = {
    en: { title: "Scheduler arena: leaderboard", requests: "requests", policy: "policy", replay: "Replay the winner",
      note: "Open the JSON that batchscope arena --rank wrote beside its report (out/arena.json). It is read here, in this browser, and sent nowhere.",
      goodput: "goodput", ttft_met: "TTFT met", tbt_met: "TBT met", output_tokens_per_s: "tokens/s",
      stall_max_s: "longest stall (ms)", norun: "no run", notjson: "is not JSON", notreport: "is not an arena report: open the .json that batchscope arena wrote",
      workloads: "workload(s)", mode: "mode", replaying: "replaying", on: "on", real: "real engine", sim: "simulator" },
    zh: { title: "调度竞技场：排行榜", requests: "个请求", policy: "策略", replay: "回放第一名",
      note: "打开 batchscope arena --rank 在报告旁写出的 JSON（out/arena.json）。它只在这个浏览器里读取，不会发送到任何地方。",
      goodput: "goodput", ttft_met: "TTFT 达标", tbt_met: "词元间隔达标", output_tokens_per_s: "词元/秒",
      stall_max_s: "最长停顿（毫秒）", norun: "未运行", notjson: "不是 JSON", notreport: "不是竞技场报告：请打开 batchscope arena 写出的 .json",
      workloads: "个工作负载", mode: "模式", replaying: "正在回放", on: "于", real: "真实引擎", sim: "模拟器" },
  };
  const lang = new URLSearchParams(location.search).get("lang") === "zh" ? "zh" : "en";
  const w = (key) => WORDS[lang][key];
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
})();
