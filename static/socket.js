// The record store and the /ws/steps connection.
// Every StepRecord and request event lands in BS.store; the chart, the metrics
// and the sparklines read only from there. A dropped socket reconnects by
// itself; the snapshot sent on connect backfills the steps it missed.
(function () {
  const BS = (window.BS = window.BS || {});
  const MAX_STEPS = 20000;        // about 10 minutes at 30 steps/s
  const MAX_BACKFILL = 2000;      // steps asked for at most after a reconnect
  let needRebuild = false;        // an older step was inserted: per-request data is recomputed once per batch
  let pending = false;            // messages arrived since the last flush

  const store = (BS.store = {
    steps: [],          // step records, ascending by .step
    reqs: new Map(),    // request id -> request summary (see newReq)
    settings: null,     // latest engine settings seen (policy event or snapshot)
    gaps: [],           // {after, before}: step indices missed between two received steps
    version: 0,         // bumps whenever anything changes; views redraw when it moves
    connected: false,
    listeners: [],
  });

  function newReq(rid, label) {
    return {
      rid, label: label == null ? rid : String(label),
      arrived: null, promptLen: null, maxTokens: null,
      first: null, end: null, endEvent: null, reason: null, outputTokens: null,
      firstStep: null, lastStep: null,
      tokens: [],       // {t, step, gap, stalled}: gap since the previous token, stalled if a step left it out in between
      stalledSince: false,
    };
  }

  function req(rid, label) {
    let r = store.reqs.get(rid);
    if (!r) { r = newReq(rid, label); store.reqs.set(rid, r); }
    if (label != null && r.label === rid) r.label = String(label);
    return r;
  }

  // ---- derived per-request data from one step ----
  function account(rec) {
    for (const it of rec.items || []) {
      const r = req(it.req, it.label);
      if (r.firstStep == null) r.firstStep = rec.step;
      r.lastStep = rec.step;
      if (it.kind === "decode" || it.completes_prompt) {
        const prev = r.tokens[r.tokens.length - 1];
        r.tokens.push({ t: rec.t_end, step: rec.step, gap: prev ? rec.t_end - prev.t : null, stalled: r.stalledSince });
        r.stalledSince = false;
        if (r.first == null) r.first = rec.t_end;
      }
    }
    for (const rid of rec.stalled || []) {
      const r = req(rid);
      r.stalledSince = true;
      r.lastStep = rec.step;
    }
  }

  function rebuild() {
    for (const r of store.reqs.values()) {
      r.tokens = []; r.firstStep = r.lastStep = null; r.stalledSince = false;
      if (r.endEvent == null) r.first = null;
    }
    for (const rec of store.steps) account(rec);
    store.gaps = [];
    for (let i = 1; i < store.steps.length; i++) {
      const a = store.steps[i - 1].step, b = store.steps[i].step;
      if (b > a + 1) store.gaps.push({ after: a, before: b });
    }
  }

  function trim() {
    if (store.steps.length <= MAX_STEPS) return;
    store.steps.splice(0, store.steps.length - MAX_STEPS);
    const first = store.steps[0].step;
    for (const [rid, r] of store.reqs) {
      if (r.end != null && (r.lastStep == null || r.lastStep < first)) store.reqs.delete(rid);
    }
    store.gaps = store.gaps.filter((g) => g.before > first);
  }

  function addStep(rec) {
    const steps = store.steps;
    const last = steps.length ? steps[steps.length - 1].step : -1;
    if (rec.step > last) {
      if (last >= 0 && rec.step > last + 1) store.gaps.push({ after: last, before: rec.step });
      steps.push(rec);
      account(rec);
      return;
    }
    // an older step (backfill): insert it if it is new, then recompute what depends on order
    let lo = 0, hi = steps.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (steps[mid].step < rec.step) lo = mid + 1; else hi = mid; }
    if (lo < steps.length && steps[lo].step === rec.step) return;
    steps.splice(lo, 0, rec);
    needRebuild = true;
  }

  function addEvent(ev) {
    const r = req(ev.req, ev.label);
    switch (ev.event) {
      case "arrived": r.arrived = ev.t; r.promptLen = ev.prompt_len; r.maxTokens = ev.max_tokens; break;
      case "first_token": r.first = ev.t; break;
      case "finished": r.end = ev.t; r.endEvent = "finished"; r.reason = ev.finish_reason; r.outputTokens = ev.output_tokens; break;
      case "aborted": r.end = ev.t; r.endEvent = "aborted"; r.reason = ev.reason; break;
      case "preempted": break;
    }
  }

  function settingsOf(obj) {
    const s = {};
    for (const k of ["policy", "max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk", "step_delay"]) {
      if (obj[k] !== undefined) s[k] = obj[k];
    }
    return s;
  }

  // One message from the socket (or from a trace file): a record, an event, a batch of them.
  BS.ingest = function (msg) {
    if (!msg || typeof msg !== "object") return;
    switch (msg.type) {
      case "step": addStep(msg); break;
      case "request": addEvent(msg); break;
      case "policy": store.settings = Object.assign({}, store.settings, settingsOf(msg)); break;
      case "snapshot": {
        if (msg.settings) store.settings = Object.assign({}, store.settings, settingsOf(msg.settings));
        const before = store.steps.length ? store.steps[store.steps.length - 1].step : null;
        const recs = msg.records || [];
        for (const m of recs) BS.ingest(m);
        // still a hole between what we had and where the snapshot starts: ask for more, once
        const first = recs.find((m) => m.type === "step");
        if (before != null && first && first.step > before + 1) {
          backfill(Math.min(MAX_BACKFILL, recs.filter((m) => m.type === "step").length + first.step - before));
        }
        break;
      }
      case "gap": backfill(300); break;   // the server skipped records for us: fetch the recent ones again
      default: return;
    }
    trim();
    store.version++;
  };

  // once per animation frame (main.js): recompute what a backfill changed, then tell the listeners
  BS.flush = function () {
    if (!pending) return;
    pending = false;
    if (needRebuild) { needRebuild = false; rebuild(); store.version++; }
    store.listeners.forEach((fn) => { try { fn(store); } catch (e) { console.error(e); } });
  };
  BS.onStore = (fn) => store.listeners.push(fn);

  BS.url = function (path) {
    // the page may be mounted under a prefix (e.g. a reverse proxy); keep it
    const base = (document.querySelector("[data-bs-root]") || {}).dataset?.bsRoot || "";
    return base + path;
  };

  // ---- the socket ----
  let ws = null, retry = 0, timer = null;

  function setConn(ok) {
    store.connected = ok;
    document.querySelectorAll("[data-testid=conn]").forEach((el) => {
      el.dataset.state = ok ? "live" : "lost";
      el.textContent = BS.t(ok ? "conn.live" : "conn.lost");
    });
  }

  BS.connect = function () {
    if (ws && ws.readyState <= 1) return;
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(proto + "//" + location.host + BS.url("/ws/steps"));
    ws.onopen = () => { retry = 0; setConn(true); };
    ws.onmessage = (e) => {
      let msg;
      try { msg = JSON.parse(e.data); } catch (err) { return; }
      if (Array.isArray(msg)) msg.forEach(BS.ingest); else BS.ingest(msg);
      pending = true;
    };
    ws.onclose = () => {
      setConn(false);
      clearTimeout(timer);
      timer = setTimeout(BS.connect, Math.min(5000, 300 * 2 ** retry++));
    };
    ws.onerror = () => { try { ws.close(); } catch (e) { /* already closed */ } };
  };

  // ask the server for the last `steps` steps again (after a gap or a reconnect); at most one pending
  let backfillTimer = null;
  function backfill(steps) {
    if (backfillTimer) return;
    backfillTimer = setTimeout(() => {
      backfillTimer = null;
      if (ws && ws.readyState === 1) ws.send(JSON.stringify({ type: "snapshot", last: steps }));
    }, 300);
  }

  // tests and the lecturer's console can cut the line to show it heals
  BS.dropSocket = function () { if (ws) ws.close(); };
})();
