"""The classroom without a browser: the label registry, the join URL and the room's routes."""
import re
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.serving.broadcast import RecordRing
from app.serving.room import MAX_NAME, SLOT_COLOURS, SLOT_SIGNS, Room, check_name, join_url
from app.ui.text import USERS

NAMES = st.text(alphabet=st.sampled_from(list("AaNnaBb 李雷 ")), min_size=1, max_size=8).filter(lambda s: s.strip())


# ---- names ----

@pytest.mark.parametrize("name, why", [("", "empty"), ("   \t", "empty"), ("x" * (MAX_NAME + 1), "too long"),
                                       ("<b>Ana</b>", "markup"), ("Ana & Bo", "markup"), ('"Ana"', "markup"),
                                       ("Ana\u0000", "control"), (None, "text"), (42, "text")])
def test_bad_names_are_refused_with_the_reason(name, why):
    with pytest.raises(ValueError, match=why):
        check_name(name)


@given(st.text(max_size=40))
def test_a_name_is_accepted_exactly_when_it_is_short_plain_text(name):
    tidy = " ".join(unicodedata.normalize("NFC", name).split())
    plain = not re.search(r"[<>&\"'`]", tidy) and all(unicodedata.category(ch)[0] != "C" for ch in tidy)
    if tidy and len(tidy) <= MAX_NAME and plain:
        assert check_name(name) == tidy
    else:
        with pytest.raises(ValueError):
            check_name(name)


# ---- labels: unique in the room, stable slots ----

@settings(max_examples=200)
@given(st.lists(NAMES, min_size=1, max_size=40))
def test_labels_are_unique_in_the_room_and_keep_the_name(names):
    room = Room(reserved=[n for n, _ in USERS])
    members = [room.join(n) for n in names]
    labels = [m.label for m in members]
    assert len({label.casefold() for label in labels}) == len(labels)
    assert not {label.casefold() for label in labels} & {n.casefold() for n, _ in USERS}
    for name, label in zip(names, labels):
        tidy = " ".join(name.split())
        assert label == tidy or re.fullmatch(re.escape(tidy) + r" \d+", label)
    assert len({m.token for m in members}) == len(members)
    # every label has its own slot, after the panel users' eight
    slots = [room.slots[label] for label in labels]
    assert len(set(slots)) == len(slots) and min(slots) >= len(USERS)


def test_a_second_ana_becomes_ana_2_and_a_rename_keeps_the_token():
    room = Room()
    ana, ana2, ana3 = room.join("Ana"), room.join("ana"), room.join(" Ana ")
    assert (ana.label, ana2.label, ana3.label) == ("Ana", "ana 2", "Ana 3")
    renamed = room.join("Bea", ana.token)
    assert renamed is ana and ana.label == "Bea" and room.member(ana.token) is ana
    assert room.join("Ana").label == "Ana 4"            # a label the chart may still show is not reused
    assert room.join("Bea", ana.token) is ana and ana.label == "Bea"


def test_leaving_frees_the_place_not_the_label(monkeypatch):
    import app.serving.room as room_module
    monkeypatch.setattr(room_module, "MAX_MEMBERS", 2)
    room = Room()
    ana, bo = room.join("Ana"), room.join("Bo")
    with pytest.raises(ValueError, match="full"):
        room.join("Cy")

    class Stream:
        reasons = []

        def close(self, reason="client went away"):
            self.reasons.append(reason)
    ana.stream = Stream()
    assert room.leave(ana.token) is ana and Stream.reasons == ["the student left the room"]
    assert room.member(ana.token) is None and room.leave(ana.token) is None and room.leave(None) is None
    assert room.join("Ana").label == "Ana 2"             # a place is free again; the chart may still show "Ana"
    assert room.slots["Ana"] != room.slots["Ana 2"] and room.member(bo.token) is bo


def test_panel_users_keep_their_colours_and_sixty_students_get_distinct_signs():
    room = Room(reserved=[n for n, _ in USERS])
    assert [room.slots[n] for n, _ in USERS] == list(range(len(USERS)))     # slot i = panel colour i, no mark
    slots = [room.slots[room.join(f"Student {i}").label] for i in range(60)]
    signs = {(s % SLOT_COLOURS, s // SLOT_COLOURS % SLOT_SIGNS) for s in slots}
    assert len(signs) == 60


def test_api_users_get_slots_from_the_stream_in_order_of_arrival():
    ring = RecordRing(16)
    room = Room()
    for label in ["bot-a", "bot-b", "bot-a", None]:
        ring.append({"type": "request", "event": "arrived", "req": "r1", "label": label, "t": 0.0})
    ring.append({"type": "step", "step": 0, "items": [{"req": "r9", "label": "ignored"}]})
    room.learn(ring)
    assert room.slots == {"bot-a": 0, "bot-b": 1}
    assert room.join("Bot-A").label == "Bot-A 2"        # a label on the chart is taken
    room.learn(ring)                                    # nothing new: nothing changes
    assert list(room.slots) == ["bot-a", "bot-b", "Bot-A 2"]


def test_suggested_names_are_friendly_and_free():
    room = Room()
    for _ in range(100):
        name = room.suggest()
        assert check_name(name) == name and room.join(name).label == name


# ---- the join URL ----

def test_join_url_prefers_the_public_url_then_the_lan_address_then_the_page_address():
    assert join_url("0.0.0.0", 7860, "https://x.hf.space/", "http://a/") == "https://x.hf.space/join"
    lan = join_url("0.0.0.0", 7860, None, "http://127.0.0.1:7860/")
    assert re.fullmatch(r"http://[\d.]+:7860/join", lan)
    assert join_url("127.0.0.1", 7860, None, "http://127.0.0.1:7860/") == "http://127.0.0.1:7860/join"


# ---- routes (no model: the service is not started) ----

@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from app.api.server import create_app
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui.page import mount_ui
    from engine import EngineConfig
    service = EngineService(EngineConfig(), ServerConfig())
    app = create_app(service, manage_service=False)
    mount_ui(app, service)
    return TestClient(app)


def test_student_and_projector_urls_lead_to_their_pages(client):
    for url, where in (("/?role=student", "/join"), ("/?view=projector&lang=zh", "/projector?lang=zh")):
        r = client.get(url, follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == where.lstrip("/")
    student = client.get("/join").text
    assert 'data-role="student"' in student and 'data-testid="student-name"' in student
    assert 'data-testid="controls"' not in student and "presenter" not in student.lower()
    projector = client.get("/projector").text
    assert 'data-role="projector"' in projector and "<svg" in projector
    assert 'data-testid="join-url">http://testserver/join<' in projector
    assert 'data-testid="controls"' not in projector and 'data-testid="student' not in projector


def test_join_refuses_bad_names_clearly_and_numbers_repeats(client):
    r = client.post("/api/room/join", json={"name": "<script>"})
    assert r.status_code == 400 and "markup" in r.json()["error"]["message"]
    r = client.post("/api/room/join", json={"name": " "})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    a = client.post("/api/room/join", json={"name": "Zoe"}).json()
    b = client.post("/api/room/join", json={"name": "Zoe"}).json()
    assert (a["label"], b["label"]) == ("Zoe", "Zoe 2") and a["token"] != b["token"]
    me = client.get("/api/room/me", headers={"X-Room-Token": b["token"]}).json()
    assert me == {"label": "Zoe 2", "slot": b["slot"], "rids": []}
    room = client.get("/api/room").json()
    assert room["labels"]["Zoe 2"] == b["slot"] and room["labels"]["Alice"] == 0
    assert client.get("/api/room/suggest").json()["name"]


def test_a_student_who_leaves_is_out_of_the_room_and_their_token_stops_working(client):
    a = client.post("/api/room/join", json={"name": "Lea"}).json()
    people = client.get("/api/room").json()["people"]
    r = client.post("/api/room/leave", headers={"X-Room-Token": a["token"]})
    assert r.status_code == 200 and r.json() == {"left": "Lea"}
    assert client.get("/api/room").json()["people"] == people - 1
    assert client.get("/api/room/me", headers={"X-Room-Token": a["token"]}).status_code == 401
    assert client.post("/api/room/leave", headers={"X-Room-Token": a["token"]}).status_code == 401
    assert client.post("/api/room/join", json={"name": "Lea"}).json()["label"] == "Lea 2"


def test_only_a_member_may_chat(client):
    r = client.post("/api/room/chat", json={"text": "hi"})
    assert r.status_code == 401 and "join" in r.json()["error"]["message"]
    r = client.post("/api/room/chat", json={"text": "hi"}, headers={"X-Room-Token": "made-up"})
    assert r.status_code == 401
