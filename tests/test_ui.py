"""The teaching UI without a browser: panel state, input checks, scenario mapping, mounting.

The test at the end drives the UI's handlers against the real engine (model marker).
"""
import asyncio
import html
import json
import re
from pathlib import Path

import pytest

from app.replay.scenarios import SCENARIOS, get_scenario
from app.ui.lessons import assign_panels, shorten
from app.ui.sessions import MAX_CHARS, Panel, Session, Sessions, Turn, check_message, fresh
from app.ui.text import LANGS, SCENARIO_BUTTONS, SHORT, STRINGS, TEXT, USERS, t
from tests.helpers import recording

STATIC = Path(__file__).resolve().parent.parent / "static"


# ---- the browser side and the server side agree ----

def test_panel_users_match_the_chart_palette():
    js = (STATIC / "palette.js").read_text()
    pairs = re.findall(r'\["(\w+)", "(#[0-9A-Fa-f]{6})"\]', js)
    assert pairs == USERS


def test_every_string_exists_in_both_languages():
    # one table per language for the whole page (static/strings/*.js, read by app/ui/text.py too)
    assert set(STRINGS["en"]) == set(STRINGS["zh"]) and len(STRINGS["en"]) > 50
    assert set(TEXT["en"]) == set(TEXT["zh"])
    assert set(SCENARIO_BUTTONS["en"]) == set(SCENARIO_BUTTONS["zh"]) == set(SCENARIOS)
    assert all(len(SHORT[code]) == len(USERS) for code in LANGS.values())


def test_every_lesson_has_its_words_a_scenario_and_known_policies():
    from app.ui.page import LESSONS
    from engine.config import POLICIES
    assert [x.policies[-1] for x in LESSONS][:7] == ["static", "continuous", "chunked", "chunked", "disaggregated",
                                                     "chunked", "chunked"]
    assert LESSONS[-1].scenario == "speculative-room"
    for k, lesson in enumerate(LESSONS, 1):
        assert lesson.policies and set(lesson.policies) <= set(POLICIES) and lesson.scenario in SCENARIOS
        key = lesson.text_key(k)
        assert all(key in TEXT[code] and f"{key}_btn" in TEXT[code] for code in LANGS.values())


def test_every_lesson_pass_states_its_full_setting_and_the_caption_shows_it():
    from app.replay.scenarios import SETTING_KEYS
    from app.ui.page import LESSONS
    from app.ui.text import setting_line
    from engine.config import EngineConfig
    for k, lesson in enumerate(LESSONS):
        sc = get_scenario(lesson.scenario)
        for i, policy in enumerate(lesson.policies):
            s = lesson.setting(sc, policy, 0.25, i)
            assert set(s) == set(SETTING_KEYS) and s["policy"] == policy and s["step_delay"] == 0.25
            # every setting a config knows at start, but the KV cap, which is live only
            EngineConfig(**{key: s[key] for key in SETTING_KEYS
                            if key not in ("policy", "step_delay", "max_kv_blocks")})
            assert s["max_prefill_chunk"] == (4 if lesson.scenario == "budget-shapes" else None)
            for code in LANGS.values():
                assert "250 ms" in setting_line(code, s)
    assert "no chunk cap" in setting_line("en", LESSONS[0].setting(get_scenario(LESSONS[0].scenario), "static", 0))
    assert "at most 4 tokens" in setting_line("en", LESSONS[3].setting(get_scenario("budget-shapes"), "chunked", 0))
    spec = LESSONS[-1]          # speculation off, then on: the caption names both
    lines = [setting_line("en", spec.setting(get_scenario(spec.scenario), p, 0, i))
             for i, p in enumerate(spec.policies)]
    assert "no speculation" in lines[0] and "up to 3 drafted tokens, matches of 1–3 tokens" in lines[1]


def test_the_cache_lessons_show_both_sides_and_say_so_in_their_captions():
    """Lesson 6: prefix caching on, then off; lesson 7: a KV cap (caching off), then a smaller max_num_seqs and
    the whole cache. Their captions end with those settings, in both languages."""
    from app.replay.scenarios import MEMORY_PRESSURE_BLOCKS
    from app.ui.page import LESSONS
    from app.ui.text import setting_line
    by = {lesson.scenario: (k, lesson) for k, lesson in enumerate(LESSONS)}
    k6, six = by["shared-system-prompt"]
    k7, seven = by["memory-pressure"]
    on, off = (six.setting(get_scenario(six.scenario), p, 0, i) for i, p in enumerate(six.policies))
    assert on["enable_prefix_caching"] is True and off["enable_prefix_caching"] is False
    assert "prefix caching on" in setting_line("en", on) and "前缀缓存关" in setting_line("zh", off)
    capped, fewer = (seven.setting(get_scenario(seven.scenario), p, 0, i) for i, p in enumerate(seven.policies))
    assert capped["max_kv_blocks"] == MEMORY_PRESSURE_BLOCKS and capped["enable_prefix_caching"] is False
    assert fewer["max_kv_blocks"] is None and fewer["max_num_seqs"] < capped["max_num_seqs"]
    assert f"KV cache capped at {MEMORY_PRESSURE_BLOCKS} blocks" in setting_line("en", capped)
    for code in LANGS.values():
        assert TEXT[code][f"step{k6 + 1}"] and TEXT[code][f"step{k7 + 1}"]
    with pytest.raises(ValueError, match="one change per pass"):
        type(six)("shared-system-prompt", ("chunked",), changes=({}, {}))
    with pytest.raises(ValueError, match="not settings"):
        type(six)("shared-system-prompt", ("chunked",), changes=({"max_kv_block": 3},))


def test_stage_has_the_test_ids_and_the_i18n_keys_it_uses():
    from app.ui.page import stage_html
    html = stage_html() + (STATIC / "student.html").read_text()
    for tid in ("gantt", "batch-bar", "policy", "chunked-toggle", "metrics", "pause", "resume", "step", "replay",
                "row-labels", "student-name", "student-box", "student-send"):
        assert f'data-testid="{tid}"' in html
    for key in re.findall(r'data-i18n(?:-placeholder)?="([\w.]+)"', html):
        assert key in STRINGS["en"], key
    # every key the scripts ask for by name exists (in both languages: the test above)
    for name in STATIC.glob("*.js"):
        for key in re.findall(r'\b(?:t|fmt)\("([\w]+\.[\w.]+)"[,)]', name.read_text()):
            assert key in STRINGS["en"], (name.name, key)


def test_chart_scripts_do_not_hard_code_visible_words_or_colours():
    # words come from the strings tables (through i18n.js), colours from palette.js
    for name in ("layout.js", "draw.js", "bar.js", "interact.js"):
        src = (STATIC / name).read_text()
        assert not re.search(r'"#[0-9a-fA-F]{3,6}"|rgba?\(', src), name
        texts = re.findall(r'fillText\("([^"]*)"', src)
        assert all(not re.search(r"[A-Za-z]{2}", t) for t in texts), (name, texts)


def test_chart_never_writes_html_from_data():
    for name in STATIC.glob("*.js"):
        src = name.read_text()
        assert not re.search(r"\.(inner|outer)HTML\s*\+?=|insertAdjacentHTML|document\.write|\beval\(", src), name


# ---- typed input ----

@pytest.mark.parametrize("text", [None, "", "   ", "\n\t"])
def test_empty_messages_are_refused_kindly(text):
    assert "empty" in check_message(text, "en")
    assert "空" in check_message(text, "zh")


def test_oversize_messages_are_refused_with_their_size():
    msg = check_message("x" * (MAX_CHARS + 1), "en")
    assert "too long" in msg and f"{MAX_CHARS + 1:,}" in msg
    assert check_message("x" * MAX_CHARS, "en") is None
    assert check_message("<b>hi</b>", "en") is None


def test_long_prompts_are_numbered_so_the_prefix_cache_cannot_hide_a_rerun():
    doc = "word " * 1000
    a, b = fresh(doc), fresh(doc)
    assert a != b and a.endswith(doc) and b.endswith(doc)
    assert fresh("short question") == "short question"


# ---- panel state ----

def test_history_sent_to_the_engine_keeps_finished_turns_only():
    p = Panel("Alice", "#E69F00")
    p.turns = [Turn("hi", "hi", reply="hello", done=True),
               Turn("bad", "bad", reply="", error="too long", done=True),
               Turn("again", "again", reply="partial", done=False)]
    assert p.messages("next") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                  {"role": "user", "content": "next"}]
    chat = p.chat()
    assert chat[3]["content"] == "⚠ too long" and chat[5]["content"] == "partial"
    p.turns.append(Turn("q", "q"))
    assert p.chat()[-1]["content"] == "…"


def test_a_reply_run_past_the_models_end_shows_where_it_ended_and_keeps_only_its_own_reply():
    """A scripted lesson's replies run to a fixed length (ignore_eos), past the model's end token, where
    the model goes on with turns of its own ("user ..."). The panel marks where the model ended, and the
    chat history of the panel's next message holds only the reply the model meant."""
    p = Panel("Alice", "#E69F00")
    p.turns = [Turn("hi", "hi", reply="Hello!\nuser\nWhat <b>", ended=6, done=True)]
    assert p.messages("next")[1] == {"role": "assistant", "content": "Hello!"}
    shown = p.chat("en")[1]["content"]
    assert shown == "Hello!\n\n" + html.escape(t("en", "past_eos")) + "\n\n" + html.escape("\nuser\nWhat <b>")
    assert t("zh", "past_eos") in p.chat("zh")[1]["content"]


def test_drive_marks_where_the_model_sampled_its_end_token_under_ignore_eos():
    """drive() notes the reply's length when the engine's end token comes by (it adds no text: the text
    after it rides on the same output); only under ignore_eos, where the reply goes on after it."""
    from app.ui.sessions import drive
    from engine import SamplingParams
    from engine.protocol import RequestOutput

    class Stream:
        id = "r1"

        def __init__(self, outs):
            self.outs = outs

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def __aiter__(self):
            for o in self.outs:
                yield o

    class Service:
        eos_token_ids = frozenset({2})

        def __init__(self, outs):
            self.outs = outs

        async def submit(self, **kw):
            return Stream(self.outs)

    def out(text, ids):
        return RequestOutput("r1", text, ids, 0)

    outs = [out("Hi", [10]), out(" there.", [11, 12]), out("user", [2, 13]), out(" more", [14])]
    for ignore_eos, ended in ((True, 9), (False, None)):
        turn = Turn("q", "q")
        params = SamplingParams(max_tokens=5, ignore_eos=ignore_eos)
        asyncio.run(drive(Service(outs), Panel("Alice", "#E69F00"), turn, [], params, asyncio.Event(), "en"))
        assert (turn.reply, turn.ended) == ("Hi there.user more", ended)
    turn = Turn("q", "q")                       # no end token: nothing is marked
    asyncio.run(drive(Service(outs[:2]), Panel("Alice", "#E69F00"), turn, [], SamplingParams(ignore_eos=True),
                      asyncio.Event(), "en"))
    assert turn.ended is None


def test_sessions_are_per_tab_and_bounded():
    s = Sessions(capacity=2)
    a = s.get("a")
    assert s.get("a") is a and s.get("b") is not a
    s.get("c")
    assert s.get("a") is not a          # the least recently used went first
    s.drop("a")
    assert s.get(None) is s.get(None)


# ---- scenarios onto panels ----

def test_scenario_users_take_panels_by_name_then_in_order():
    s = Session()
    panels = assign_panels(s, get_scenario("long-prompt-interrupts"))
    assert {k: p.name for k, p in panels.items()} == {"Alice": "Alice", "Bob": "Bob", "Carol": "Carol", "Doc": "Dan"}
    assert s.visible == 4
    s = Session()
    panels = assign_panels(s, get_scenario("static-vs-continuous"))
    assert [panels[f"U{i}"].name for i in range(1, 9)] == [name for name, _ in USERS]
    assert s.visible == 8


def test_more_scenario_users_than_panels_share_them():
    s = Session()
    sc = get_scenario("bursty", n=20)
    panels = assign_panels(s, sc)
    assert len(panels) == 20 and len({p.name for p in panels.values()}) == 8


def test_long_scripted_prompts_are_shortened_for_display():
    text = "Summarise this.\n\n" + "x" * 5000
    shown = shorten(text)
    assert len(shown) < 300 and shown.startswith("Summarise this.") and "5,017" not in shown
    assert f"+{len(text) - 220:,} characters" in shown
    assert shorten("short") == "short"


# ---- mounting on the FastAPI app ----

@pytest.fixture(scope="module")
def mounted():
    from fastapi.testclient import TestClient

    from app.api.server import create_app
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui.page import mount_ui
    from engine import EngineConfig
    service = EngineService(EngineConfig(), ServerConfig())        # not started: no model needed here
    app = create_app(service, manage_service=False)
    mount_ui(app, service)
    return TestClient(app)


def test_gradios_queue_does_not_wake_the_event_loop_every_millisecond_while_idle(mounted):
    """The page's Gradio queue looks for new events every `sleep_when_free` seconds while it has none
    (Gradio's default: 1 ms, a thousand wake-ups a second of the event loop that also streams every reply).
    mount_ui sets a calmer wait, long enough not to cost an idle server, short beside a click's reply."""
    from app.ui.page import QUEUE_IDLE_WAIT_S
    queues = [r.app.blocks._queue for r in mounted.app.routes if hasattr(getattr(r, "app", None), "blocks")]
    assert len(queues) == 1
    assert queues[0].sleep_when_free == QUEUE_IDLE_WAIT_S and 0.01 <= QUEUE_IDLE_WAIT_S <= 0.05
    assert queues[0].progress_update_sleep_when_free >= QUEUE_IDLE_WAIT_S


def test_page_loads_the_chart_scripts_with_versions(mounted):
    page = mounted.get("/")
    assert page.status_code == 200
    config = mounted.get("/config").json()
    head = config.get("head") or ""
    for name in ("i18n.js", "layout.js", "draw.js", "interact.js", "socket.js", "controls.js", "metrics.js", "room.js",
                 "main.js", "style.css"):
        assert re.search(rf"/static/batchscope/{re.escape(name)}\?v=[0-9a-f]{{10}}", head), name


def test_static_files_are_served_and_gradio_assets_are_not_shadowed(mounted):
    r = mounted.get("/static/batchscope/interact.js")
    assert r.status_code == 200 and "initChart" in r.text
    assert mounted.get("/static/batchscope/../app/ui/page.py").status_code == 404
    config = mounted.get("/config").json()
    assert json.dumps(config).count("bs-chat-") == 8       # eight panels exist (four visible at first)


# ---- the handlers against the real engine ----

@pytest.mark.model
def test_two_panels_share_steps_and_a_scenario_runs_on_the_step_clock():
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui.page import UI
    from engine import EngineConfig

    service = EngineService(EngineConfig(kv_cache_gb=0.25, policy="chunked"), ServerConfig())
    service.start()
    records = []

    class Tab:
        session_hash = "tab"

    async def main():
        async with recording(service, records):
            ui = UI(service, max_tokens=6,
                    scenario_params={"long-prompt-interrupts": dict(reply_tokens=16, doc_tokens=2, doc_at=8)})

            async def drain(gen):
                return [out async for out in gen]
            a, b = await asyncio.gather(drain(ui.send(0, "Say hi.", Tab())), drain(ui.send(1, "Say bye.", Tab())))
            empty = await drain(ui.send(2, "   ", Tab()))
            empty.append(len(ui.sessions.get("tab").panels[2].turns))
            everyone = await drain(ui.send_all(3, "Hello, everyone.", Tab()))
            empty.append(everyone)
            await drain(ui.run_scenario("long-prompt-interrupts", "continuous", "", Tab()))
        return ui, a, b, empty

    try:
        ui, a, b, empty = asyncio.run(main())
    finally:
        service.stop()
    s = ui.sessions.get("tab")
    assert service.eos_token_ids == frozenset(service.loop.engine.eos_token_ids) != frozenset()
    alice, bob = s.panels[0].turns[0], s.panels[1].turns[0]
    assert alice.reply and bob.reply and not alice.error and not bob.error
    assert len(a) >= 3 and a[-1][0][-1]["content"] == html.escape(alice.reply)   # streamed, then complete
    everyone = empty.pop()
    assert "empty" in empty[0][2] and empty[-1] == 0                    # refused before the engine
    # send to all: the four visible panels got the message and a reply each, in one shared stream
    to_all = [p.turns[1] if p.name in ("Alice", "Bob") else p.turns[0] for p in s.panels[:4]]
    assert all(t.full == "Hello, everyone." and t.reply and t.done and not t.error for t in to_all)
    assert len(everyone[-1]) == 8 * 3 + 2 and everyone[-1][3][-1]["content"] == html.escape(to_all[3].reply)
    assert not any(p.turns for p in s.panels[4:])
    steps = [r for r in records if r["type"] == "step"]
    shared = [r for r in steps if {alice.rid, bob.rid} <= {i["req"] for i in r["items"]}]
    assert shared, "the two panels never shared a step"
    # the scenario: Doc (in Dan's panel) arrived on step 8 of the run and stalled the others under continuous
    doc = s.panels[3].turns[-1]
    arrived = next(r for r in records if r.get("event") == "arrived" and r["req"] == doc.rid)
    assert arrived["label"] == "Dan" and arrived["prompt_len"] > 1000
    big = next(r for r in steps if any(i["req"] == doc.rid and i["kind"] == "prefill" for i in r["items"]))
    assert big["policy"] == "continuous" and len(big["stalled"]) == 3
    first = next(r for r in steps if any(i["req"] == s.panels[0].turns[-1].rid for i in r["items"]))
    assert big["step"] - first["step"] >= 8
    assert all(p.turns[-1].done and not p.turns[-1].error for p in s.panels[:4])


def test_lessons_change_settings_only_with_the_presenter_key():
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui.page import UI
    from engine import EngineConfig
    locked = UI(EngineService(EngineConfig(), ServerConfig(presenter_key="s3cret")))
    assert locked.authorised("s3cret")
    assert not locked.authorised("") and not locked.authorised(None) and not locked.authorised("s3cre")
    assert UI(EngineService(EngineConfig(), ServerConfig())).authorised(None)
