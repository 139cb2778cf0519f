// Start-up and the one animation loop. The page's HTML may arrive after this script (Gradio
// renders it), so wait for the stage to exist, then start the socket and the views once.
// The stage's data-role (lecturer, student, projector) says which parts the server sent.
(function () {
  const BS = (window.BS = window.BS || {});
  let started = false, last = 0;

  // frames and chart redraws, for the room demo and tests (demos/room.py reads it)
  const perf = (BS.perf = { frames: 0, draws: 0, drawMs: 0, maxDrawMs: 0, slowFrames: 0 });

  function frame(now) {
    if (last && now - last > 1000 / 30) perf.slowFrames++;    // a frame that missed 30 fps
    last = now;
    perf.frames++;
    BS.flush();
    const t0 = performance.now();
    if (BS.chartFrame(now)) {
      const ms = performance.now() - t0;
      perf.draws++; perf.drawMs += ms; perf.maxDrawMs = Math.max(perf.maxDrawMs, ms);
    }
    BS.metricsFrame(now);
    if (BS.roomFrame) BS.roomFrame(now);
    if (BS.whyFrame) BS.whyFrame(now);
    if (BS.kvFrame) BS.kvFrame(now);
    requestAnimationFrame(frame);
  }

  function start() {
    const stage = document.querySelector("[data-testid=stage]");
    if (started || !stage) return false;
    started = true;
    BS.role = stage.dataset.role || "lecturer";
    const lang = new URLSearchParams(location.search).get("lang");
    if (lang) BS.setLang(lang); else BS.applyLang(document);
    BS.drawSwatches(stage);
    BS.initChart(stage);
    if (stage.querySelector("[data-testid=controls]")) BS.initControls(stage);
    BS.initMetrics(stage);
    if (BS.fitChart) BS.fitChart();
    BS.initRoom(stage);
    if (stage.querySelector("[data-testid=why]")) BS.initWhy(stage);   // the lecturer's "why" views
    if (!BS.offline) BS.connect();         // offline: a recorded stream is fed by BS.ingestAll
    requestAnimationFrame(frame);
    return true;
  }

  // strings inside Gradio-rendered parts (chat panel headers) appear later too
  function watch() {
    if (start()) return;
    const mo = new MutationObserver(() => { if (start()) mo.disconnect(); });
    mo.observe(document.documentElement, { childList: true, subtree: true });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", watch);
  else watch();
})();
