"""The stage's animation loop rests when nothing moves: an idle tab looks ten times a second instead of at
every frame, and news or the viewer's hand brings the frames back at once (static/main.js)."""
from contextlib import closing

from tests.browser import MARKS, load_stage
from tests.factories import arrived, dec, step

pytestmark = MARKS

PERF = "({...BS.perf})"


def steps(first: int, n: int) -> list[dict]:
    return [step(i, 0.1 * i, 0.1 * i + 0.09, [dec("r0", 10 + i)]) for i in range(first, first + n)]


def rate(page, ms: int = 1000) -> dict:
    """Frames, idle looks and chart draws in `ms` of the page's time."""
    a = page.evaluate(PERF)
    page.wait_for_timeout(ms)
    b = page.evaluate(PERF)
    return {k: b[k] - a[k] for k in ("frames", "idleTicks", "draws")}


def test_an_idle_stage_rests_and_news_or_a_hand_wakes_it(browser):
    with closing(browser.new_page(viewport={"width": 1366, "height": 768})) as page:
        load_stage(page, [arrived("r0", 0.0), *steps(0, 4)])
        page.wait_for_function("BS.perf.draws > 0")
        page.wait_for_timeout(2500)                      # past the 2 s without news
        idle = rate(page)
        assert idle["frames"] <= 15 and idle["idleTicks"] >= 3, idle      # ten looks a second, not 60 frames

        # news: a step fed in is drawn at the next frame, before the resting loop's next look, and the
        # frames come back
        looks_before_drawn = page.evaluate("""async (s) => {
            const looks = BS.perf.idleTicks, draws = BS.perf.draws;
            BS.ingestAll(s);
            while (BS.perf.draws === draws) await new Promise((r) => requestAnimationFrame(r));
            return BS.perf.idleTicks - looks; }""", steps(4, 1))
        assert looks_before_drawn == 0
        assert rate(page, 500)["idleTicks"] == 0

        # the viewer's hand: the pointer over the chart wakes a resting loop too
        page.wait_for_timeout(2500)
        assert rate(page, 500)["frames"] <= 8
        box = page.locator("[data-testid=gantt]").bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        awake = rate(page, 500)
        assert awake["idleTicks"] == 0 and awake["frames"] > 0, awake
