"""The teaching UI: Gradio Blocks at `/`, on the same FastAPI app as the API.

    app = create_app(service)
    mount_ui(app, service)          # /static/batchscope (the chart's JS and CSS) and / (this page)

The page has three parts. The stage (static/controls.html and chart.html, drawn
by the scripts in static/) holds the engine controls, the live chart fed by
/ws/steps and the metrics. Students and the projector get the same chart on
pages of their own (app/ui/room_pages.py). The teaching steps and scenario buttons drive scripted users. The
chat panels are Gradio components, one named, coloured user each, streaming
from the engine through the service's in-process API (app/ui/sessions.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging

import gradio as gr
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from app.api.auth import key_matches
from app.replay.scenarios import LESSONS, SCENARIOS, Lesson, get_scenario, load_text
from app.serving.rate_limit import client_of
from app.serving.room import Room
from app.ui import lessons
from app.ui.assets import STATIC, STATIC_URL, head_html, stage_html
from app.ui.leaderboard import mount_leaderboard
from app.ui.room_pages import mount_room
from app.ui.sessions import Session, Sessions, Stage, Turn, check_message, drive, fresh, stream_all
from app.ui.text import LANGS, SCENARIO_BUTTONS, SHORT, SUMMARY_ASK, USERS, setting_line, t
from engine import SamplingParams

log = logging.getLogger(__name__)

MAX_PANELS = len(USERS)
KEY_JS = "(...a) => [...a.slice(0, -1), (window.sessionStorage && sessionStorage.getItem('batchscope.key')) || '']"


def panel_head(index: int) -> str:
    name, color = USERS[index]
    name = html.escape(name)
    return (f'<div class="bs-panel-head" data-testid="panel-head-{index}">'
            f'<span class="bs-dot" style="background:{color}"></span><span>{name}</span>'
            f'<span class="bs-spark-wrap"><canvas data-spark="{name}" data-testid="spark-{index}"></canvas>'
            f'<span class="bs-spark-gap" data-spark-gap></span></span></div>')


def notice_html(text: str) -> str:
    return f'<div class="bs-error" role="alert">{html.escape(text)}</div>' if text else ""


def mine_html(session: Session) -> str:
    """This tab's request ids, for the sparklines, and the lesson a lesson pressed in another tab stopped
    here, whose caption above the chart then says so (static/lesson.js); hidden."""
    stopped = f' data-stopped="{session.stopped}"' if session.stopped else ""
    return f'<span data-mine="{html.escape(" ".join(session.request_ids()))}"{stopped}></span>'


class UI:
    def __init__(self, service, max_tokens: int = 128, scenario_params: dict | None = None,
                 doc_max_tokens: int = 48):
        self.service = service
        self.max_tokens, self.doc_max_tokens = max_tokens, doc_max_tokens
        self.scenario_params = scenario_params or {}
        self.sessions = Sessions()
        self.stage = Stage()        # the lesson playing on the engine, whichever tab pressed it
        self.doc = load_text("lighthouse_report")
        self._doc_tokens: int | None = None

    # ---- helpers ----
    def session(self, request: gr.Request | None) -> Session:
        return self.sessions.get(getattr(request, "session_hash", None))

    def authorised(self, key: str | None) -> bool:
        return key_matches(self.service.config.presenter_key, key)

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=0.6, top_p=0.9)

    def doc_turn(self, lang: str) -> Turn:
        ask = SUMMARY_ASK[lang]
        if self._doc_tokens is None:
            self._doc_tokens = round(len(self.doc) / 4.5, -2)    # about; the chart shows the exact count
        return Turn(shown=t(lang, "doc_shown", ask=ask, tokens=f"~{self._doc_tokens:,.0f}"),
                    full=fresh(f"{ask}\n\n{self.doc}"))

    # ---- renders ----
    def render_one(self, s: Session, i: int, clear_box: bool = True):
        p = s.panels[i]
        return [p.chat(s.lang), "" if clear_box else gr.skip(), notice_html(p.notice), mine_html(s)]

    def render_all(self, s: Session, columns: bool):
        cols = [gr.update(visible=i < s.visible) for i in range(MAX_PANELS)] if columns else [gr.skip()] * MAX_PANELS
        return ([p.chat(s.lang) for p in s.panels] + [notice_html(p.notice) for p in s.panels] + cols
                + [mine_html(s)])

    # ---- chat events ----
    async def send(self, i: int, text: str | None, request: gr.Request, preset: str | None = None):
        s = self.session(request)
        panel = s.panels[i]
        if preset == "short":
            turn = Turn(shown=SHORT[s.lang][i], full=SHORT[s.lang][i])
        elif preset == "long":
            turn = self.doc_turn(s.lang)
        else:
            panel.notice = check_message(text, s.lang) or ""
            if panel.notice:
                yield [panel.chat(s.lang), gr.skip(), notice_html(panel.notice), mine_html(s)]
                return
            turn = Turn(shown=text, full=text)
        panel.notice = ""
        messages = panel.messages(turn.full)
        panel.turns.append(turn)
        changed = asyncio.Event()
        max_tokens = self.doc_max_tokens if preset == "long" else None
        job = drive(self.service, panel, turn, messages, self.params(max_tokens), changed, s.lang, _client(request))
        clear = preset is None
        async for _ in stream_all([job], changed, lambda: None):
            yield self.render_one(s, i, clear_box=clear)
            clear = False

    async def send_all(self, i: int, text: str | None, request: gr.Request):
        s = self.session(request)
        problem = check_message(text, s.lang)
        s.panels[i].notice = problem or ""
        if problem:
            yield self.render_all(s, columns=False) + [gr.skip()]
            return
        changed, jobs = asyncio.Event(), []
        for p in s.panels[:s.visible]:
            p.notice = ""
            turn = Turn(shown=text, full=text)
            messages = p.messages(text)
            p.turns.append(turn)
            jobs.append(drive(self.service, p, turn, messages, self.params(), changed, s.lang, _client(request)))
        clear = True
        async for _ in stream_all(jobs, changed, lambda: None):
            yield self.render_all(s, columns=False) + ["" if clear else gr.skip()]
            clear = False

    def lesson_setting(self, lesson: Lesson, policy: str, index: int = 0) -> dict:
        """Everything pass `index` of a lesson sets (app/replay/scenarios.py Lesson.setting)."""
        scenario = get_scenario(lesson.scenario, **self.scenario_params.get(lesson.scenario, {}))
        return lesson.setting(scenario, policy, self.service.config.step_delay, index)

    async def run_scenario(self, name: str, policies: tuple[str, ...] | str | None, key: str, request: gr.Request,
                           lesson: Lesson | None = None):
        """Play a scenario through this tab's panels (app/ui/lessons.py run): once per policy, each pass
        under its lesson's full setting, or once under the settings in force (no policies, or no presenter
        key). `lesson`: the lesson whose passes these are; else one made of the name and the policies."""
        policies = (policies,) if isinstance(policies, str) else tuple(policies or ())
        s = self.session(request)
        scenario = get_scenario(name, **self.scenario_params.get(name, {}))
        lesson = lesson or (next((x for x in LESSONS if (x.scenario, x.policies) == (name, policies)),
                                 Lesson(name, policies)) if policies else None)
        first = True
        async with contextlib.aclosing(lessons.run(self.service, s, scenario, lesson, policies,
                                                   self.authorised(key), self.stage)) as notes:
            async for note in notes:
                s.note = note
                yield self.render_all(s, columns=first) + [note(s.lang)]
                first = False

    def lesson_text(self, lang: str, k: int) -> str:
        """Lesson k's caption and, last, the settings each of its passes runs under."""
        lesson = LESSONS[k]
        lines = [setting_line(lang, self.lesson_setting(lesson, p, i)) for i, p in enumerate(lesson.policies)]
        return lesson_words(lang, k) + "\n\n" + t(lang, "lesson_setting", setting=t(lang, "set.then").join(lines))

    # ---- panel management ----
    def resize(self, delta: int, request: gr.Request):
        s = self.session(request)
        s.visible = max(1, min(MAX_PANELS, s.visible + delta))
        return [gr.update(visible=i < s.visible) for i in range(MAX_PANELS)]

    def clear(self, request: gr.Request):
        s = self.session(request)
        for p in s.panels:
            p.turns, p.notice = [], ""
        return self.render_all(s, columns=False)

    def drop(self, request: gr.Request):
        self.sessions.drop(getattr(request, "session_hash", None))


def build_ui(service, **options) -> gr.Blocks:
    ui = UI(service, **options)
    with gr.Blocks(title="batchscope") as demo:
        # ---- header, language, teaching steps ----
        with gr.Row(equal_height=True):
            with gr.Column(scale=5):
                title = gr.Markdown(t("en", "title"), elem_classes="bs-title")
                subtitle = gr.Markdown(t("en", "subtitle"))
            lang = gr.Radio(list(LANGS), value="English", label=t("en", "lang"), scale=1,
                            elem_id="bs-lang", elem_classes="bs-lang")
        steps_title = gr.Markdown(t("en", "steps_title"))
        with gr.Row(equal_height=True):
            lesson_md, lesson_btn = [], []
            for k in range(len(LESSONS)):
                with gr.Column(elem_classes="bs-lesson", min_width=160):
                    lesson_md.append(gr.Markdown(ui.lesson_text("en", k), elem_id=f"bs-lesson-text-{k + 1}"))
                    lesson_btn.append(gr.Button(lesson_words("en", k, "_btn"), variant="primary",
                                                elem_id=f"bs-lesson-{k + 1}"))
        with gr.Row(equal_height=True):
            scen_label = gr.Markdown(t("en", "scenarios"))
            scen_btn = {name: gr.Button(SCENARIO_BUTTONS["en"].get(name, name), size="sm",
                                        elem_id=f"bs-scenario-{name}") for name in SCENARIOS}
        note = gr.Markdown("", elem_id="bs-note")
        key = gr.Textbox(visible=False)

        # ---- the stage (controls, chart, metrics: static/) with the chat panels in a column beside it,
        # so a lecturer types into a chat with the chart in view ----
        with gr.Row(equal_height=False, elem_id="bs-main"):
            with gr.Column(scale=3, min_width=620, elem_id="bs-left"):
                # the stage brings its own look (static/style.css): none of the Gradio theme's prose styles
                gr.HTML(stage_html(), js_on_load=None, apply_default_css=False, elem_id="bs-stage-block")
                gr.HTML((STATIC / "whatif.html").read_text(), js_on_load=None, elem_id="bs-whatif")   # replay
            with gr.Column(scale=1, min_width=300, elem_id="bs-chats"):
                with gr.Row(elem_classes="bs-chatbar"):
                    add_btn = gr.Button(t("en", "add"), size="sm", elem_id="bs-add", min_width=60)
                    remove_btn = gr.Button(t("en", "remove"), size="sm", elem_id="bs-remove", min_width=60)
                    clear_btn = gr.Button(t("en", "clear"), size="sm", elem_id="bs-clear", min_width=60)
                    stop_btn = gr.Button(t("en", "stop"), size="sm", variant="stop", elem_id="bs-stop", min_width=60)
                mine = gr.HTML(mine_html(Session()), elem_classes="bs-mine", js_on_load=None)
                cols, chats, boxes, notices, sends, shorts, longs, alls = [], [], [], [], [], [], [], []
                for i in range(MAX_PANELS):
                    panel = _panel(i)
                    for part, store in zip(panel, (cols, chats, boxes, notices, sends, alls, shorts, longs)):
                        store.append(part)

        # ---- events ----
        streaming = []
        every = dict(concurrency_limit=None, show_progress="hidden")
        for i in range(MAX_PANELS):
            one = [chats[i], boxes[i], notices[i], mine]
            send = _typed_send(ui, i, None)
            streaming.append(sends[i].click(send, [boxes[i]], one, **every))
            streaming.append(boxes[i].submit(send, [boxes[i]], one, **every))
            streaming.append(shorts[i].click(_typed_send(ui, i, "short"), None, one, **every))
            streaming.append(longs[i].click(_typed_send(ui, i, "long"), None, one, **every))
            streaming.append(alls[i].click(_typed_send_all(ui, i), [boxes[i]],
                                           chats + notices + cols + [mine, boxes[i]], **every))
        everyone = chats + notices + cols + [mine, note]
        for k, lesson in enumerate(LESSONS):
            play = _typed_scenario(ui, lesson.scenario, lesson.policies, lesson)
            show = f"(...a) => {{ if (window.BS && BS.showLesson) BS.showLesson({k + 1}); return ({KEY_JS})(...a); }}"
            streaming.append(lesson_btn[k].click(play, [key], everyone, js=show, **every))
        for name, btn in scen_btn.items():
            streaming.append(btn.click(_typed_scenario(ui, name, ()), [key], everyone, js=KEY_JS, **every))

        def add(request: gr.Request):
            return ui.resize(1, request)

        def remove(request: gr.Request):
            return ui.resize(-1, request)

        for i in range(MAX_PANELS):          # the Chatbot's own trash button empties that panel for good
            chats[i].clear(_typed_clear(ui, i), None, [notices[i], mine])
        add_btn.click(add, None, cols)
        remove_btn.click(remove, None, cols)
        clear_btn.click(ui.clear, None, chats + notices + cols + [mine], cancels=streaming)
        stop_btn.click(None, None, None, cancels=streaming)

        def switch_language(choice: str, request: gr.Request):
            code = LANGS.get(choice, "en")
            s = ui.session(request)
            s.lang = code
            return ([t(code, "title"), t(code, "subtitle"), gr.update(label=t(code, "lang")), t(code, "steps_title")]
                    + [ui.lesson_text(code, k) for k in range(len(LESSONS))]
                    + [gr.update(value=lesson_words(code, k, "_btn")) for k in range(len(LESSONS))]
                    + [t(code, "scenarios")]
                    + [gr.update(value=SCENARIO_BUTTONS[code].get(n, n)) for n in scen_btn]
                    + [gr.update(value=t(code, w)) for w in ("add", "remove", "clear", "stop")]
                    + [gr.update(placeholder=t(code, "placeholder", name=USERS[i][0])) for i in range(MAX_PANELS)]
                    + [gr.update(value=t(code, "send")) for _ in sends]
                    + [gr.update(value=t(code, "all")) for _ in alls]
                    + [gr.update(value=t(code, "short")) for _ in shorts]
                    + [gr.update(value=t(code, "long")) for _ in longs]
                    + [s.note(code) if s.note else gr.skip()])

        lang.change(switch_language, [lang],
                    [title, subtitle, lang, steps_title] + lesson_md + lesson_btn + [scen_label]
                    + list(scen_btn.values()) + [add_btn, remove_btn, clear_btn, stop_btn]
                    + boxes + sends + alls + shorts + longs + [note],
                    js=f"(c) => {{ if (window.BS && BS.setLang) BS.setLang(({json.dumps(LANGS)})[c] || 'en'); "
                       "return c; }")
        demo.unload(ui.drop)
    demo.bs_ui = ui
    return demo


def _panel(i: int) -> tuple:
    """One user's chat panel: (column, chatbot, textbox, notice, send, send-to-all, short, long)."""
    with gr.Column(visible=i < 4, min_width=200, elem_classes="bs-panel", elem_id=f"bs-panel-{i}") as col:
        gr.HTML(panel_head(i), js_on_load=None)
        chat = gr.Chatbot(height=130, show_label=False, render_markdown=False, buttons=[],
                          feedback_options=None, elem_id=f"bs-chat-{i}")
        box = gr.Textbox(show_label=False, lines=1, max_lines=4, elem_id=f"bs-box-{i}",
                         placeholder=t("en", "placeholder", name=USERS[i][0]))
        notice = gr.HTML("", js_on_load=None, elem_id=f"bs-notice-{i}")
        with gr.Row(elem_classes="bs-panel-buttons"):
            send = gr.Button(t("en", "send"), size="sm", variant="primary", elem_id=f"bs-send-{i}", min_width=50)
            every = gr.Button(t("en", "all"), size="sm", elem_id=f"bs-all-{i}", min_width=50)
            short = gr.Button(t("en", "short"), size="sm", elem_id=f"bs-short-{i}", min_width=50)
            long = gr.Button(t("en", "long"), size="sm", elem_id=f"bs-long-{i}", min_width=50)
    return col, chat, box, notice, send, every, short, long


# Gradio finds gr.Request by the handler's type hints, so each event gets a real, typed function.
def _typed_send(ui: UI, i: int, preset: str | None):
    if preset:
        async def handler(request: gr.Request):
            async for out in ui.send(i, None, request, preset):
                yield out
    else:
        async def handler(text: str | None, request: gr.Request):
            async for out in ui.send(i, text, request):
                yield out
    return handler


def _typed_clear(ui: UI, i: int):
    def handler(request: gr.Request):
        s = ui.session(request)
        s.panels[i].turns, s.panels[i].notice = [], ""
        return "", mine_html(s)
    return handler


def _typed_send_all(ui: UI, i: int):
    async def handler(text: str | None, request: gr.Request):
        async for out in ui.send_all(i, text, request):
            yield out
    return handler


def lesson_words(lang: str, k: int, part: str = "") -> str:
    """LESSONS[k]'s caption (part "") or button ("_btn"); its number is its place in LESSONS."""
    lesson = LESSONS[k]
    key = lesson.text_key(k + 1) + part
    return t(lang, key, k=k + 1) if lesson.text else t(lang, key)


def _typed_scenario(ui: UI, name: str, policies: tuple[str, ...], lesson: Lesson | None = None):
    async def handler(key: str | None, request: gr.Request):
        async for out in ui.run_scenario(name, policies, key, request, lesson):
            yield out
    return handler


def theme() -> gr.themes.Base:
    """Gradio's default theme with button fills that keep white text at 4.5:1 or more (WCAG 1.4.3; its own
    orange is 2.8:1 and its red 3.8:1): orange-700 and red-700, one shade darker when hovered."""
    fills = dict(button_primary_background_fill="#C2410C", button_primary_background_fill_hover="#9A3412",
                 button_primary_text_color="#FFFFFF", button_cancel_background_fill="#B91C1C",
                 button_cancel_background_fill_hover="#991B1B", button_cancel_text_color="#FFFFFF")
    return gr.themes.Default().set(**fills, **{k + "_dark": v for k, v in fills.items()})


# How long the page's Gradio queue waits before it looks again for a new event while it has none. Gradio's
# own wait is 1 ms: a thousand wake-ups a second, while idle, of the event loop that also streams every
# student's reply. A button's event now starts at most 20 ms later, unseen beside the step it asks for.
QUEUE_IDLE_WAIT_S = 0.02


def calm_queue(blocks: gr.Blocks):
    """Give the page's Gradio queue QUEUE_IDLE_WAIT_S between looks for a new event while it is free, and its
    progress loop a tenth of a second (the page shows no Gradio progress bar). Gradio has no public setting
    for either: a Gradio whose queue lacks the attribute keeps its own waits, and the log says so."""
    queue = getattr(blocks, "_queue", None)
    if queue is None or not hasattr(queue, "sleep_when_free"):
        log.warning("this Gradio's queue has no sleep_when_free: it keeps its own idle wait")
        return
    queue.sleep_when_free = QUEUE_IDLE_WAIT_S
    queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, 0.1)


def mount_ui(app: FastAPI, service, path: str = "/", **options) -> FastAPI:
    """Serve static/ at /static/batchscope, the classroom pages (/join, /projector, /api/room) and
    the lecturer's Gradio page at `path` on the given app."""
    app.mount(STATIC_URL, StaticFiles(directory=STATIC), name="batchscope-static")
    app.state.room = Room(reserved=[name for name, _ in USERS])
    mount_room(app, service, app.state.room, head_html(), max_tokens=options.get("max_tokens", 128))
    mount_leaderboard(app, head_html(), STATIC_URL)
    blocks = build_ui(service, **options)
    calm_queue(blocks)
    return gr.mount_gradio_app(app, blocks, path=path, head=head_html(), theme=theme(),
                               footer_links=[], ssr_mode=False)


def _client(request: gr.Request) -> str | None:
    """The browser's address for the rate limit; None when Gradio gives no connection (in-process calls)."""
    peer = getattr(request, "client", None)
    return client_of(getattr(request, "headers", None) or {}, getattr(peer, "host", None))
