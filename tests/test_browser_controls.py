"""The engine controls show the settings in force, however late an answer the page asked for earlier
arrives: the page's first look at /api/engine (and its polls while the prefill/decode pair loads) must
not undo a change made since."""
import time

from engine import EngineConfig
from tests.browser import MARKS, api, chromium, conn_is, served_ui, wait_js

pytestmark = MARKS

# every GET of /api/engine is sent at once but its answer held back until the test lets it through
HOLD_GETS = """
  window.heldGets = [];
  const real = window.fetch;
  window.fetch = (u, o) => {
    if (!String(u).endsWith('/api/engine') || (o && o.method && o.method !== 'GET')) return real(u, o);
    const answer = real(u, o);
    return new Promise((ok) => window.heldGets.push(() => ok(answer)));
  };"""
CHECKED = "document.querySelector('[data-testid=policy] button[aria-checked=true]')?.dataset.policy"


def test_an_answer_asked_for_before_a_change_does_not_undo_it(tiny_model):
    from app.ui.plain_page import mount_plain
    config = EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.05, policy="chunked")
    with served_ui(config, mount=mount_plain) as (url, _), chromium() as browser:
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        page.add_init_script(HOLD_GETS)
        page.goto(url + "/")
        wait_js(page, conn_is("live") + " && "
                      "window.heldGets.length === 1")                      # the page's first look, held
        wait_js(page, f"{CHECKED} === 'chunked'")                          # from the socket meanwhile
        page.click("[data-testid=policy] button[data-policy=continuous]")
        wait_js(page, f"{CHECKED} === 'continuous'")
        assert api(url, "/api/engine")["policy"] == "continuous"
        page.evaluate("window.heldGets.splice(0).forEach((let_through) => let_through())")   # "chunked", stale
        time.sleep(1.0)
        page.evaluate("window.heldGets.splice(0).forEach((let_through) => let_through())")   # a second look
        time.sleep(1.0)
        assert page.evaluate(CHECKED) == "continuous", "an answer from before the change undid it on the page"
        assert api(url, "/api/engine")["policy"] == "continuous"
