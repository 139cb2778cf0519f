"""Classroom mode in a real browser: three students and a projector on one server.

Debian's Chromium through Playwright, as in test_browser_ui.py (skipped without /usr/bin/chromium).
The QR code on the projector is decoded from a screenshot with zxing-cpp.
"""
import io
import json
import urllib.error
import urllib.request

import pytest

from tests.browser import MARKS, conn_is, served_ui

pytestmark = MARKS
KEY = "lecturer-secret"


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="chunked"), dict(presenter_key=KEY, step_delay=0.03),
                   max_tokens=10) as (url, _):
        yield url


def open_page(browser, url, errors, **ctx):
    pg = browser.new_context(**ctx).new_page()
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(url)
    pg.wait_for_function(conn_is("live"))
    return pg


def join(pg, name):
    pg.wait_for_function("document.querySelector('[data-testid=student-name]').value !== ''")  # the suggestion
    pg.fill("[data-testid=student-name]", name)
    pg.click("[data-testid=join]")
    pg.wait_for_selector("[data-testid=you-are]:not([hidden])")
    return pg.inner_text("[data-testid=my-label]")


def rows(pg):
    return pg.evaluate("[...document.querySelectorAll('[data-testid=row-labels] li')]"
                       ".map(l => ({label: l.dataset.label, rid: l.dataset.rid, mine: l.dataset.mine === 'true'}))")


def test_three_students_and_a_projector(server, browser, tmp_path):
    errors = []
    students = [open_page(browser, server + "/?role=student", errors, viewport={"width": 1200, "height": 1000})
                for _ in range(3)]
    projector = open_page(browser, server + "/?view=projector", errors, viewport={"width": 1920, "height": 1080})

    # names: the server makes them unique, and refuses markup with a clear message
    students[2].fill("[data-testid=student-name]", "<b>Bo</b>")
    students[2].click("[data-testid=join]")
    students[2].wait_for_selector("[data-testid=join-error]:not([hidden])")
    assert "markup" in students[2].inner_text("[data-testid=join-error]")
    labels = [join(pg, name) for pg, name in zip(students, ["Ana", "ana", "Bo"])]
    assert labels == ["Ana", "ana 2", "Bo"]

    # each sends its own message; nobody else's words reach their page
    texts = ["Tell me about owls.", "Tell me about ferries.", "Tell me about maple trees."]
    for pg, text in zip(students, texts):
        pg.fill("[data-testid=student-box]", text)
        pg.click("[data-testid=student-send]")
    for pg in students:
        pg.wait_for_function("BS.mine.size === 1 && [...BS.mine].every(r => BS.store.reqs.get(r) && "
                             "BS.store.reqs.get(r).end != null)", timeout=180_000)
        pg.wait_for_function("document.querySelector('.bs-msg-bot span').textContent !== '…'")
    replies = [pg.inner_text(".bs-msg-bot span") for pg in students]
    assert all(replies), replies
    projector.wait_for_function("document.querySelectorAll('[data-testid=row-labels] li').length >= 3")

    own_rids = [pg.evaluate("[...BS.mine]") for pg in students]
    assert len({r for rids in own_rids for r in rids}) == 3
    for i, pg in enumerate(students):
        pg.wait_for_function("document.querySelectorAll('[data-testid=row-labels] li').length >= 3")
        shown = rows(pg)
        assert {r["label"] for r in shown} >= set(labels)
        assert [r["rid"] for r in shown if r["mine"]] == own_rids[i], shown        # exactly its own rows
        assert all(r["label"] == labels[i] for r in shown if r["mine"])
        body = pg.inner_text("body")
        for j in range(3):
            if j != i:
                assert texts[j] not in body and replies[j] not in body
        # no engine controls on the page, and the server refuses a student's engine change
        assert pg.locator("[data-testid=controls], [data-testid=policy], [data-testid=chunked-toggle]").count() == 0
        status = pg.evaluate("fetch('/api/engine', {method: 'POST', headers: {'Content-Type': 'application/json'},"
                             " body: JSON.stringify({policy: 'static'})}).then(r => r.status)")
        assert status == 403

    # every screen gives a label the same colour and mark, and the three are told apart
    signs = [pg.evaluate(f"{json.dumps(labels)}.map(l => [BS.colorOf(l), BS.markOf(l)])")
             for pg in students + [projector]]
    assert all(s == signs[0] for s in signs) and len({tuple(s) for s in signs[0]}) == 3

    # the projector: every row, none of them "mine", the join URL as text and as a QR code that decodes to it
    assert not any(r["mine"] for r in rows(projector))
    url = projector.inner_text("[data-testid=join-url]")
    assert url == server + "/join"
    assert decode_qr(projector.locator("[data-testid=join-qr]").screenshot()) == url
    assert projector.locator("[data-testid=controls], [data-testid=student]").count() == 0
    projector.wait_for_function("document.querySelector('[data-testid=room-count]').textContent === '3'")

    # the name is kept for the tab: a reload finds the same label and the same rows
    students[1].reload()
    students[1].wait_for_selector("[data-testid=you-are]:not([hidden])")
    assert students[1].inner_text("[data-testid=my-label]") == "ana 2"
    students[1].wait_for_function("[...document.querySelectorAll('[data-testid=row-labels] li[data-mine=true]')]"
                                  f".map(l => l.dataset.rid).join() === {json.dumps(','.join(own_rids[1]))}")

    # leaving: the room counts one fewer on the projector, the tab forgets its token, and a new join
    # gets a new label (the chart still shows "ana 2")
    students[2].click("[data-testid=leave]")
    students[2].wait_for_selector("[data-testid=you-are][hidden]", state="attached")
    assert students[2].locator("[data-testid=leave]").is_hidden()
    assert students[2].inner_text("[data-testid=join]") == "Join"
    projector.wait_for_function("document.querySelector('[data-testid=room-count]').textContent === '2'")
    students[2].reload()
    students[2].wait_for_selector("[data-testid=join]")
    assert students[2].locator("[data-testid=you-are]").is_hidden()
    assert not errors, errors


def decode_qr(png: bytes) -> str:
    import zxingcpp
    from PIL import Image
    found = zxingcpp.read_barcodes(Image.open(io.BytesIO(png)))
    assert len(found) == 1 and found[0].format == zxingcpp.BarcodeFormat.QRCode, found
    return found[0].text


def test_a_student_without_a_token_cannot_chat_and_bad_names_get_reasons(server):
    def post(path, body, headers=None):
        req = urllib.request.Request(server + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read().decode().splitlines()[0])
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    assert post("/api/room/chat", {"text": "hi"})[0] == 401
    for name, why in (("", "empty"), ("x" * 25, "too long"), ("<i>", "markup")):
        code, body = post("/api/room/join", {"name": name})
        assert code == 400 and why in body["error"]["message"], body
    code, me = post("/api/room/join", {"name": "Cy"})
    assert code == 200
    assert post("/api/room/chat", {"text": "  "}, {"X-Room-Token": me["token"]})[0] == 400
