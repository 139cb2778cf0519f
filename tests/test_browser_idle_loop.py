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


# each clear of the chart's canvas, so each chart draw, takes 15 ms more: a device far slower than this one
SLOW_DRAW = """
const clear = CanvasRenderingContext2D.prototype.clearRect;
CanvasRenderingContext2D.prototype.clearRect = function (...a) {
  if (this.canvas.dataset.testid === "gantt") { const t = performance.now(); while (performance.now() - t < 15) {} }
  return clear.apply(this, a);
};
"""


def test_a_slow_device_draws_news_as_often_as_it_affords_and_ends_on_the_newest_step(browser):
    """News every 10 ms for 2 s on a page whose chart draws are slow: the chart draws only as often as the page
    affords (static/interact.js DRAW_SHARE: the next draw waits ten times the last draw's time), so drawing keeps
    to about a tenth of the page's time instead of all of it, and the newest step is drawn once the news stops.
    Before, such a page drew at every frame that brought news, and its frames slowed to the draws' pace."""
    with closing(browser.new_page(viewport={"width": 1366, "height": 768})) as page:
        page.add_init_script(SLOW_DRAW)
        load_stage(page, [arrived("r0", 0.0), *steps(0, 4)])
        page.wait_for_function("BS.perf.draws > 0")
        got = page.evaluate("""async (s) => {
            const a = {...BS.perf}, t0 = performance.now();
            for (const one of s) { BS.ingestAll([one]); await new Promise((r) => setTimeout(r, 10)); }
            const b = {...BS.perf}, ms = performance.now() - t0;
            return {draws: b.draws - a.draws, frames: b.frames - a.frames, share: (b.drawMs - a.drawMs) / ms}; }""",
                            steps(4, 200))
        assert got["draws"] > 0 and got["share"] < 0.2, got
        assert got["frames"] > 2 * got["draws"], got            # frames between draws: the page stays responsive
        page.wait_for_function("BS.view.drawn.steps.at(-1) === BS.store.steps.at(-1).step && "
                               "BS.store.steps.at(-1).step === 203", timeout=5_000)
