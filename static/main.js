// Start-up: the page's HTML may arrive after this script (Gradio renders it),
// so wait for the stage to exist, then start the socket and the views once.
(function () {
  const BS = (window.BS = window.BS || {});
  let started = false;

  function start() {
    const stage = document.querySelector("[data-testid=stage]");
    if (started || !stage) return false;
    started = true;
    BS.applyLang(document);
    BS.drawSwatches(stage);
    BS.initGantt(stage);
    BS.initControls(stage);
    BS.initMetrics(stage);
    BS.initWhy(stage);
    if (!BS.offline) BS.connect();
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
