"""The page where Gradio is not installed (a GPU machine often has none): the live chart, the engine
controls and the metrics at `/`, the classroom pages (/join, /projector), and a notice that the chat
panels need Gradio. The API, /ws/steps and /metrics come from app/api/server.py as always.

    app = create_app(service)
    mount_plain(app, service)       # instead of app.ui.page.mount_ui
"""
from __future__ import annotations

import html
from string import Template

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from app.serving.room import Room
from app.ui.assets import STATIC, STATIC_URL, head_html
from app.ui.room_pages import mount_room
from app.ui.text import USERS

NOTICE = ("The chat panels need gradio, which is not installed on this server (pip install gradio). "
          "The live chart, the engine controls, the OpenAI-compatible API (/v1/chat/completions), "
          "the step stream (/ws/steps) and /metrics work; students can chat from /join.")


def gradio_installed() -> bool:
    try:
        import gradio  # noqa: F401  (app.ui.page imports it next anyway where it is present)
    except ImportError:
        return False
    return True


def plain_page() -> str:
    """The lecturer's stage (controls, chart, metrics) in the classroom pages' frame, under the notice."""
    notice = f'<div class="bs-error" role="status" data-testid="needs-gradio">{html.escape(NOTICE)}</div>'
    top = notice + (STATIC / "controls.html").read_text()
    chart = (STATIC / "chart.html").read_text() + (STATIC / "why.html").read_text()
    return Template((STATIC / "room.html").read_text()).substitute(
        role="lecturer", head=head_html(), top=top, chart=chart, title="batchscope")


def mount_plain(app: FastAPI, service, max_tokens: int = 128) -> FastAPI:
    app.mount(STATIC_URL, StaticFiles(directory=STATIC), name="batchscope-static")
    app.state.room = Room(reserved=[name for name, _ in USERS])
    mount_room(app, service, app.state.room, head_html(), max_tokens=max_tokens)
    body = plain_page()

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return body
    return app
