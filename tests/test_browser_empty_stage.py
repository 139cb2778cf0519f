"""The stage within its bounds, on a phone and on a projector: before the first step its "no steps yet"
words are whole and readable where they are drawn (on the chart's canvas, in the metrics' box), nothing
is wider than the screen, with steps or without, and no canvas draws a label past its edges."""
from contextlib import closing

import pytest

from tests.browser import MARKS, load_stage
from tests.factories import arrived, dec, step

pytestmark = MARKS

# every text the Gantt's canvas draws: its words, where its ink starts and ends, and the canvas's width
RECORD_TEXT = """
  window.drawnTexts = [];
  const fill = CanvasRenderingContext2D.prototype.fillText;
  CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
    if (this.canvas.dataset.testid === 'gantt') {
      const m = this.measureText(text), scale = this.getTransform().a;
      window.drawnTexts.push({text: String(text), left: x - m.actualBoundingBoxLeft,
                              right: x + m.actualBoundingBoxRight, width: this.canvas.width / scale});
    }
    return fill.call(this, text, x, y, ...rest);
  };"""


# the stage's elements that reach past the screen's right edge, but those inside a box that clips or scrolls
# them (the metrics' scroller, the screen reader's copies of the chart)
WIDE = """(w) => { const root = document.querySelector('[data-testid=stage]');
  const held = (e) => { for (let a = e.parentElement; a && a !== root; a = a.parentElement)
      if (getComputedStyle(a).overflowX !== 'visible') return true;
    return false; };
  return [...root.querySelectorAll('*')]
    .filter(e => e.getBoundingClientRect().right > w + 0.5 && e.offsetParent !== null && !held(e))
    .map(e => (e.dataset.testid || e.className || e.tagName) + ' ' + Math.round(e.getBoundingClientRect().right)); }"""


@pytest.mark.parametrize("size", [(360, 780), (390, 844), (1366, 768)])
def test_no_steps_yet_is_whole_and_nothing_overflows_the_screen(size, browser):
    width, height = size
    with closing(browser.new_page(viewport={"width": width, "height": height})) as page:
        page.add_init_script(RECORD_TEXT)
        load_stage(page, [])
        page.wait_for_function("window.drawnTexts.length > 0")
        page.wait_for_timeout(300)
        empty = page.evaluate("BS.t('metrics.empty')")

        # the chart's words: every word of the message drawn, each line inside the canvas
        drawn = page.evaluate("window.drawnTexts")
        assert " ".join(d["text"] for d in drawn).split() == empty.split(), drawn
        outside = [d for d in drawn if d["left"] < 0 or d["right"] > d["width"]]
        assert not outside, f"drawn past the canvas's edge at {width}px: {outside}"

        # the metrics' words: at most two lines, not one word a line in a column of its own
        box = page.evaluate("""() => { const c = document.querySelector('[data-testid=metrics] caption');
            const r = c.getBoundingClientRect(), lh = parseFloat(getComputedStyle(c).fontSize) * 1.3;
            return {text: c.textContent, lines: Math.round(r.height / lh)}; }""")
        assert box["text"] == empty
        assert box["lines"] <= 2, f"the metrics' empty note takes {box['lines']} lines at {width}px"

        # nothing wider than the screen: no sideways scrolling on a phone
        wide = page.evaluate(WIDE, width)
        assert not wide, f"wider than the {width}px screen: {wide[:6]}"
        assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_the_empty_charts_record_of_what_it_drew_has_every_part_a_full_one_has(browser):
    """BS.view.drawn (what hover, the chart's text and the tests read) has the same parts before the first
    step as after it, empty: a reader waiting for a part (drawn.markers.length) never meets undefined."""
    with closing(browser.new_page(viewport={"width": 1366, "height": 768})) as page:
        load_stage(page, [])
        page.wait_for_function("BS.view.drawn !== null")
        empty = page.evaluate("BS.view.drawn")
        load_stage(page, steps_of_three())
        page.wait_for_function("BS.view.drawn.steps.length === 6")
        full = page.evaluate("Object.keys(BS.view.drawn)")
        assert sorted(empty) == sorted(full)
        assert all(empty[k] in ([], None) for k in empty), empty


def steps_of_three() -> list[dict]:
    reqs = ["r0", "r1", "r2"]
    return [arrived(r, 0.0) for r in reqs] + [step(i, 0.1 * i, 0.1 * i + 0.09, [dec(r, 10 + i) for r in reqs])
                                              for i in range(6)]


@pytest.mark.parametrize("width", [360, 390])
def test_a_phone_scrolls_no_stage_sideways_once_steps_are_drawn(width, browser):
    """The same on a phone once there are steps: the metrics, the step's X-ray table and the other views
    under the chart keep within the screen (a table wider than it scrolls inside its own panel)."""
    with closing(browser.new_page(viewport={"width": width, "height": 844})) as page:
        load_stage(page, steps_of_three())
        page.wait_for_function("document.querySelectorAll('[data-testid=step-xray] tbody tr').length === 3")
        page.wait_for_timeout(300)
        assert page.evaluate("document.documentElement.scrollWidth") <= width, page.evaluate(WIDE, width)


# every text any canvas of the stage draws: its ink's box, through the canvas's transform (a rotated axis
# title too), in the canvas's own pixels, beside the canvas's size in them
RECORD_ALL_TEXT = """
  window.drawnTexts = [];
  const fill = CanvasRenderingContext2D.prototype.fillText;
  CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
    if (this.canvas.closest('[data-testid=stage]')) {
      const m = this.measureText(text), at = this.getTransform();
      const corners = [[x - m.actualBoundingBoxLeft, y - m.actualBoundingBoxAscent],
                       [x + m.actualBoundingBoxRight, y + m.actualBoundingBoxDescent],
                       [x - m.actualBoundingBoxLeft, y + m.actualBoundingBoxDescent],
                       [x + m.actualBoundingBoxRight, y - m.actualBoundingBoxAscent]]
        .map(([px, py]) => at.transformPoint({x: px, y: py}));
      const xs = corners.map(c => c.x), ys = corners.map(c => c.y);
      window.drawnTexts.push({text: String(text), canvas: this.canvas.dataset.testid || this.canvas.className,
                              left: Math.min(...xs), right: Math.max(...xs), top: Math.min(...ys),
                              bottom: Math.max(...ys), width: this.canvas.width, height: this.canvas.height});
    }
    return fill.call(this, text, x, y, ...rest);
  };"""


@pytest.mark.parametrize("width", [390, 1366])
def test_no_text_on_the_stages_canvases_runs_past_their_edges(width, browser):
    """The chart, the batch bar and the why views' plots keep every label inside their canvas (a label by
    a line near the right edge goes to the line's left)."""
    with closing(browser.new_page(viewport={"width": width, "height": 900})) as page:
        page.add_init_script(RECORD_ALL_TEXT)
        load_stage(page, steps_of_three())
        page.wait_for_function("document.querySelectorAll('[data-testid=step-xray] tbody tr').length === 3")
        page.wait_for_timeout(500)
        drawn = page.evaluate("window.drawnTexts")
        assert {d["canvas"] for d in drawn} >= {"gantt", "batch-bar"}, {d["canvas"] for d in drawn}
        outside = [d for d in drawn if d["left"] < -1 or d["right"] > d["width"] + 1 or d["top"] < -1
                   or d["bottom"] > d["height"] + 1]
        assert not outside, f"drawn past a canvas's edge at {width}px: {outside[:6]}"
