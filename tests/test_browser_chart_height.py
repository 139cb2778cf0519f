"""The Gantt's height follows its rows: it grows at once, and shrinks once the smaller size has been
wanted for a moment, even when nothing else redraws it (an idle class, a projector window made smaller)."""
from contextlib import closing

from tests.browser import MARKS, load_stage
from tests.factories import arrived, dec, step

pytestmark = MARKS


def stream(n_reqs: int) -> list[dict]:
    reqs = [f"r{i}" for i in range(n_reqs)]
    out = [arrived(r, 0.0) for r in reqs]
    out += [step(i, 0.1 * i, 0.1 * i + 0.09, [dec(r, 10 + i) for r in reqs]) for i in range(6)]
    return out


def height(page) -> float:
    return page.evaluate("document.querySelector('[data-testid=gantt]').getBoundingClientRect().height")


def tall_chart(browser):
    """A 1366x768 page whose chart has grown with twelve rows; (page, its script errors)."""
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    load_stage(page, stream(12))
    page.wait_for_function("document.querySelector('[data-testid=gantt]').getBoundingClientRect().height > 300")
    return page, errors


def test_the_chart_grows_with_its_rows_and_shrinks_when_idle(browser):
    page, errors = tall_chart(browser)
    with closing(page):
        tall = height(page)
        # its rows drawn smaller want less room (within the room it has), then one redraw only
        page.evaluate("BS.chartScale = 0.6; BS.redrawChart()")
        page.wait_for_timeout(300)
        assert height(page) == tall, "it shrank at once: a passing dip would make it jump"
        page.wait_for_function("document.querySelector('[data-testid=gantt]').getBoundingClientRect().height"
                               f" <= {0.6 * tall + 2}", timeout=6000)
        assert not errors, errors


def test_a_smaller_room_shrinks_the_chart_at_once(browser):
    """The room the page leaves the chart falls (a projector's metrics table grew a line, a window made
    smaller): a chart that kept its height for the shrink's wait would push the page past the screen."""
    page, errors = tall_chart(browser)
    with closing(page):
        page.evaluate("BS.chartMaxH = 250; BS.redrawChart()")
        page.wait_for_function("document.querySelector('[data-testid=gantt]').getBoundingClientRect().height <= 252",
                               timeout=700)       # well inside draw.js's wait before a shrink (1.5 s)
        assert not errors, errors
