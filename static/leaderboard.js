// The arena leaderboard (app/leaderboard.py): a report JSON picked by the presenter, read in this browser,
// ranked per workload; "replay" reloads the chart frame and feeds it the winner's records, as a trace.
(function () {
  const $ = (id) => document.querySelector(`[data-testid=${id}]`);
  const COLS = [["goodput", "goodput", 100, "%"], ["ttft_met", "TTFT met", 100, "%"], ["tbt_met", "TBT met", 100, "%"],
    ["output_tokens_per_s", "tokens/s", 1, ""], ["stall_max_s", "longest stall (ms)", 1000, ""]];
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
    for (const [name, w] of Object.entries(doc.workloads)) {
      const byName = new Map(w.results.map((r) => [r.policy, r]));
      box.append(el("h3", `${name}: ${w.requests} requests`));
      box.append(el("p", w.description, { class: "bs-lb-note" }));
      const table = el("table", null, { "data-workload": name, class: "bs-lb-table" });
      const head = el("tr");
      ["#", "policy", ...COLS.map((c) => c[1]), ""].forEach((h) => head.append(el("th", h)));
      table.append(head);
      w.ranking.forEach((policy, i) => {
        const r = byName.get(policy), part = r && (r.real || r.sim);
        const tr = el("tr", null, { "data-policy": policy });
        tr.append(el("td", String(i + 1)), el("td", policy));
        if (r.error || !part) tr.append(el("td", r.error || "no run", { colspan: String(COLS.length), class: "bs-lb-error" }));
        else COLS.forEach(([k, , scale, unit]) => tr.append(el("td", fmt(part.score[k], scale, unit))));
        const cell = el("td");
        if (i === 0 && part && !r.error) {
          const b = el("button", "Replay the winner", { type: "button", "data-testid": "lb-replay", "data-workload": name });
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
      status(`replaying ${result.policy} on ${name} (${result.real ? "real engine" : "simulator"})`);
    };
    frame.src = frame.dataset.src + "?run=" + encodeURIComponent(name) + "&t=" + Date.now();   // a fresh chart each time
  }

  function open(file) {
    file.text().then((text) => {
      let d;
      try { d = JSON.parse(text); } catch (e) { return status(`${file.name} is not JSON: ${e.message}`, true); }
      if (!d || d.type !== "arena_report" || !d.workloads) {
        return status(`${file.name} is not an arena report: open the .json that batchscope arena wrote`, true);
      }
      doc = d;
      render();
      status(`${file.name}: ${Object.keys(d.workloads).length} workload(s), mode ${d.mode}`);
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("lb-file").addEventListener("change", (e) => e.target.files[0] && open(e.target.files[0]));
  });
})();
