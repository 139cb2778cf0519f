"""The stage looks the same on the lecturer's Gradio page as on the plain page (the same static/ parts in
static/room.html's frame, no Gradio): every element of it, compared by its computed style in Chromium.

Gradio's stylesheet restyles every element under its container (buttons grey with a 0.2 s fade, no
padding, headings as plain text, radio buttons redrawn, padded table cells, border-box sizing), with
selectors up to three classes deep; static/style.css starts every rule of the stage at #bs-stage so that
none of it reaches the stage. Sizes that follow the page's width (width, height) are not compared."""
from __future__ import annotations

import pytest

from engine import EngineConfig
from tests.browser import MARKS, chromium, conn_is, served_ui, wait_js

pytestmark = MARKS

PROPS = ["color", "backgroundColor", "borderTopWidth", "borderRightWidth", "borderBottomWidth", "borderLeftWidth",
         "borderTopStyle", "borderTopColor", "borderRadius", "paddingTop", "paddingRight", "paddingBottom",
         "paddingLeft", "marginTop", "marginRight", "marginBottom", "marginLeft", "fontSize", "fontWeight",
         "fontFamily", "fontStyle", "lineHeight", "textAlign", "textTransform", "boxSizing", "display", "appearance",
         "listStyleType", "verticalAlign", "transitionDuration", "boxShadow", "opacity"]

# every element under the stage, named by the nearest of itself and its ancestors with an id or a test id,
# then tag, first class and place among same-tag siblings below it: a name both pages give the same element
STYLES = """(props) => { const root = document.querySelector('[data-testid=stage]'); const out = {};
  const name = (el) => { const parts = []; while (el && el !== root) {
      if (el.id) { parts.unshift('#' + el.id); break; }
      if (el.dataset.testid) { parts.unshift('[' + el.dataset.testid + ']'); break; }
      const same = [...el.parentElement.children].filter(c => c.tagName === el.tagName);
      const cls = el.classList.length ? '.' + el.classList[0] : '';
      parts.unshift(el.tagName.toLowerCase() + cls + ':' + same.indexOf(el));
      el = el.parentElement; } return parts.join(' > '); };
  for (const el of root.querySelectorAll('*')) {
    if (el.closest('[data-testid=needs-gradio]')) continue;      // the plain page's notice, on it alone
    const s = getComputedStyle(el);
    const got = Object.fromEntries(props.map(p => [p, s[p]]));
    if (got.borderTopWidth === '0px') { got.borderTopStyle = got.borderTopColor = 'no border'; }
    out[name(el)] = got; }
  return out; }"""


def stage_styles(browser, url: str) -> dict:
    pg = browser.new_page(viewport={"width": 1366, "height": 900})
    pg.goto(url + "/")
    wait_js(pg, "window.BS && BS.store && " + conn_is("live"))
    # the engine's settings have reached the controls, and the switch's knob has finished sliding
    wait_js(pg, "document.querySelector('[data-testid=policy] button[aria-checked=true]') && "
                "document.getAnimations().length === 0")
    styles = pg.evaluate(STYLES, PROPS)
    pg.close()
    return styles


@pytest.fixture(scope="module")
def both_pages(tiny_model):
    from app.ui.plain_page import mount_plain
    config = EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.05)
    with served_ui(config) as (gradio_url, _), served_ui(config, mount=mount_plain) as (plain_url, _), \
            chromium() as browser:
        yield stage_styles(browser, gradio_url), stage_styles(browser, plain_url)


def test_every_element_of_the_stage_looks_as_on_the_plain_page(both_pages):
    gradio, plain = both_pages
    shared = sorted(set(gradio) & set(plain))
    assert len(shared) >= 150, f"only {len(shared)} elements of the stage found on both pages"
    # the pressed lesson's caption is the lecturer's page's own (app/ui/assets.stage_html)
    assert set(gradio) ^ set(plain) <= {"[lesson-caption]"}, sorted(set(gradio) ^ set(plain))
    differ = {name: {p: (gradio[name][p], plain[name][p]) for p in PROPS if gradio[name][p] != plain[name][p]}
              for name in shared}
    differ = {name: d for name, d in differ.items() if d}
    assert not differ, f"{len(differ)} elements look otherwise on the Gradio page (Gradio's, plain's): " + \
        "; ".join(f"{name} {d}" for name, d in list(differ.items())[:8])


BUTTONS = {"[chunked-toggle]", "[chunk-cap-clear]", "[pause]", "[resume]", "[step-back]", "[step]", "[replay]",
           "[table-toggle]", "[apply-budget]"}
WHITE, BLACK, GREY, THEME_GREY = "rgb(255, 255, 255)", "rgb(34, 34, 34)", "rgb(238, 238, 238)", "rgb(228, 228, 231)"


def test_no_button_of_the_stage_fades_or_wears_the_host_theme(both_pages):
    gradio, _ = both_pages
    buttons = {name: s for name, s in gradio.items() if name in BUTTONS or name.startswith("[policy] > button")}
    assert len(buttons) == len(BUTTONS) + 4, sorted(buttons)
    faded = {name: s["transitionDuration"] for name, s in buttons.items() if s["transitionDuration"] != "0s"}
    assert not faded, f"buttons that fade between states (an accessibility check can catch them mid-way): {faded}"
    backgrounds = {name: s["backgroundColor"] for name, s in buttons.items()}
    assert THEME_GREY not in backgrounds.values(), backgrounds
    # the policies: white, but the one in force (chunked) black; "No cap" is disabled while there is no cap
    assert sorted(v for name, v in backgrounds.items() if name.startswith("[policy]")) == [WHITE] * 3 + [BLACK]
    assert backgrounds["[chunk-cap-clear]"] == GREY and backgrounds["[pause]"] == WHITE
