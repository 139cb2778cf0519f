"""The arena leaderboard in Chromium: a report JSON opened in the page is ranked per workload, and the
winner's run replays on the chart (served by the app's own routes; no engine needed)."""
import json
import socket
import textwrap
import threading
import time

import pytest

from tests.browser import ARGS, CHROMIUM, MARKS, chromium  # noqa: F401

pytestmark = MARKS


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from app.cli import main as cli
    d = tmp_path_factory.mktemp("lb")
    subs = d / "subs"
    subs.mkdir()
    (subs / "spf.py").write_text(open("demos/arena/policies/shortest_prompt_first.py").read())
    (subs / "greedy.py").write_text(textwrap.dedent("""
        from engine.scheduling.policy import Policy
        class Greedy(Policy):
            def schedule(self, step):
                return [(r, r.remaining) for r in step.running + step.waiting]
        """))
    assert cli(["arena", "--rank", str(subs), "--workload", "chat-burst", "--workload", "long-documents",
                "--cost", "0.01,0.0005,0.000001", "--scale", "0.25", "--out", str(d / "arena.html")]) == 0
    return d / "arena.json"


@pytest.fixture(scope="module")
def server():
    import uvicorn
    from fastapi import FastAPI
    from fastapi.staticfiles import StaticFiles

    from app.ui.leaderboard import mount_leaderboard
    from app.ui.page import STATIC, STATIC_URL, head_html
    app = FastAPI()
    app.mount(STATIC_URL, StaticFiles(directory=STATIC))
    mount_leaderboard(app, head_html(), STATIC_URL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive()
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(30)


def test_the_leaderboard_ranks_a_report_and_replays_the_winner(report, server):
    doc = json.loads(report.read_text())
    with chromium() as browser:
        pg = browser.new_page(viewport={"width": 1300, "height": 1000})
        errors = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(server + "/leaderboard")
        pg.set_input_files("[data-testid=lb-file]", str(report))
        pg.wait_for_selector("table[data-workload=long-documents]")
        for name, w in doc["workloads"].items():
            rows = pg.eval_on_selector_all(f"table[data-workload={name}] tr[data-policy]",
                                           "(trs) => trs.map((tr) => tr.dataset.policy)")
            assert rows == w["ranking"] and rows[-1] == "greedy" and len(rows) == 5
        error = pg.text_content("table[data-workload=chat-burst] tr[data-policy=greedy] .bs-lb-error")
        assert "broke rule `budget`" in error
        first = doc["workloads"]["chat-burst"]["results"]
        winner = next(r for r in first if r["policy"] == doc["workloads"]["chat-burst"]["ranking"][0])
        gp = pg.text_content("table[data-workload=chat-burst] tr[data-policy] td:nth-child(3)")
        assert gp == f"{winner['sim']['score']['goodput'] * 100:.0f}%"
        pg.click("[data-testid=lb-replay][data-workload=chat-burst]")
        pg.wait_for_function("document.querySelector('[data-testid=lb-chart]').dataset.replayed === 'chat-burst'")
        frame = pg.frame_locator("[data-testid=lb-chart]")
        frame.locator("[data-testid=gantt]").wait_for()
        steps = sum(1 for r in winner["sim"]["stream"] if r.get("type") == "step")
        chart = next(f for f in pg.frames if "leaderboard/chart" in f.url)
        chart.wait_for_function(f"BS.store.steps.length === {steps} && BS.perf.draws > 0")
        # another workload's winner: a fresh chart, not the two runs mixed
        pg.click("[data-testid=lb-replay][data-workload=long-documents]")
        pg.wait_for_function("document.querySelector('[data-testid=lb-chart]').dataset.replayed === 'long-documents'")
        lw = doc["workloads"]["long-documents"]
        win2 = next(r for r in lw["results"] if r["policy"] == lw["ranking"][0])
        chart = next(f for f in pg.frames if "leaderboard/chart" in f.url)
        chart.wait_for_function(
            f"BS.store.steps.length === {sum(1 for r in win2['sim']['stream'] if r.get('type') == 'step')}")
        pg.set_input_files("[data-testid=lb-file]", str(report.with_suffix(".html")))
        pg.wait_for_function("document.querySelector('[data-testid=lb-status]').dataset.state === 'error'")
        pg.goto(server + "/leaderboard?lang=zh")
        pg.set_input_files("[data-testid=lb-file]", str(report))
        pg.wait_for_selector("[data-testid=lb-replay]")
        assert pg.text_content("[data-testid=leaderboard] h2") == "调度竞技场：排行榜"
        assert pg.text_content("[data-testid=lb-replay]") == "回放第一名"
        assert not errors, errors
