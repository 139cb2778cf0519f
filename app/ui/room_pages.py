"""Classroom routes: the student page, the projector view, and the room's small API.

    /join  (or /?role=student)   one chat, the live chart and the metrics; no engine controls
    /projector (or /?view=projector)   chart, batch bar and metrics in large type, and a join box
    GET  /api/room               {labels: {label: slot}, people, join_url}: colours for every screen
    GET  /api/room/suggest       {name}: a friendly free name for the join box
    POST /api/room/join          {name, token?} -> {token, label, slot}; 400 with the reason if refused
    GET  /api/room/me            (X-Room-Token) -> {label, slot, rids}
    POST /api/room/leave         (X-Room-Token) -> {left: label}; a streaming reply is aborted
    POST /api/room/chat          (X-Room-Token) {text} -> NDJSON lines {rid} {text}... {done}|{error}

The server decides what each role may do: a student's token allows chatting under
its own label and nothing else (engine settings stay behind the presenter key),
and a student's page is sent without the controls at all. Replies go only to the
student who asked; the shared step stream carries labels and counts, never text.
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from string import Template
from urllib.parse import parse_qs

import segno
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from app.api.errors import APIError, admission_error, read_json
from app.api.openai_api import AbortOnDisconnect
from app.serving.rate_limit import client_of
from app.serving.room import Member, Room, join_url
from app.ui.sessions import check_message
from engine import SamplingParams

STATIC = Path(__file__).resolve().parent.parent.parent / "static"
HISTORY_TURNS = 4             # earlier exchanges the engine sees with a student's new message


def fragment(name: str) -> str:
    return (STATIC / name).read_text()


def qr_svg(url: str) -> str:
    """The join URL as an inline SVG QR code (segno; medium error correction survives a projector)."""
    return segno.make(url, error="m").svg_inline(scale=8, border=4, dark="#000", light="#fff", omitsize=True)


def page(role: str, head: str, top: str) -> str:
    return Template(fragment("room.html")).substitute(
        role=role, head=head, top=top, chart=fragment("chart.html"),
        title="batchscope · " + ("projector" if role == "projector" else "join"))


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def join_box(url: str, loopback: bool = False) -> str:
    """loopback: the server listens on this machine only, so phones cannot reach the address: say so,
    and name the flag that fixes it."""
    warn = ('<div class="bs-join-warn" data-testid="join-warning" role="alert" data-i18n="room.loopback"></div>'
            if loopback else "")
    return ('<aside class="bs-joinbox" data-testid="join-box">'
            '<div class="bs-join-title" data-i18n="room.projector"></div>'
            '<div class="bs-join-hint" data-i18n="room.scan"></div>'
            f'<div class="bs-qr" data-testid="join-qr" data-url="{html.escape(url)}">{qr_svg(url)}</div>'
            f'<div class="bs-join-url" data-testid="join-url">{html.escape(url)}</div>{warn}'
            '<div class="bs-join-count"><span data-testid="room-count">0</span> '
            '<span data-i18n="room.people"></span></div></aside>')


class RoleRedirect:
    """`/?role=student` and `/?view=projector` are the pages /join and /projector (a plain ASGI
    middleware: it leaves every other request, and its disconnects, untouched)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/" and scope["method"] == "GET":
            q = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
            lang = f"?lang={q['lang']}" if q.get("lang") in ("en", "zh") else ""
            where = "join" if q.get("role") == "student" else "projector" if q.get("view") == "projector" else None
            if where:
                return await RedirectResponse(where + lang, status_code=307)(scope, receive, send)
        await self.app(scope, receive, send)


class Lines:
    """An NDJSON body whose cleanup runs however it ends, even when the client left before the first
    line (a plain async generator that never started would skip its `finally`)."""

    def __init__(self, gen, cleanup):
        self.gen, self.cleanup = gen, cleanup

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.gen.__anext__()

    async def aclose(self):
        try:
            await self.gen.aclose()
        finally:
            self.cleanup()


def mount_room(app: FastAPI, service, room: Room, head: str, max_tokens: int = 128):
    cfg = service.config

    def url_for(request: Request) -> str:
        return join_url(cfg.host, request.url.port or cfg.port, cfg.public_url,
                        str(request.base_url))

    app.add_middleware(RoleRedirect)

    @app.get("/join", response_class=HTMLResponse)
    async def student_page():
        return page("student", head, fragment("student.html"))

    @app.get("/projector", response_class=HTMLResponse)
    async def projector_page(request: Request):
        loopback = cfg.host in LOOPBACK and not cfg.public_url
        return page("projector", head, join_box(url_for(request), loopback))

    @app.get("/api/room")
    async def room_state(request: Request):
        room.learn(service.ring)
        return {"labels": room.slots, "people": len(room.members), "join_url": url_for(request)}

    @app.get("/api/room/suggest")
    async def suggest():
        return {"name": room.suggest()}

    @app.post("/api/room/join")
    async def join(request: Request):
        body = await read_json(request, 4096)
        if not isinstance(body, dict):
            raise APIError(400, "send a JSON object: {\"name\": \"...\"}")
        room.learn(service.ring)            # labels already on the chart are taken too
        try:
            member = room.join(body.get("name"), body.get("token"))
        except ValueError as e:
            raise APIError(400, f"cannot use that name: {e}", param="name", code="bad_name") from None
        return {"token": member.token, "label": member.label, "slot": room.slots.get(member.label)}

    def member_of(request: Request) -> Member:
        member = room.member(request.headers.get("x-room-token"))
        if member is None:
            raise APIError(401, "join the room first (POST /api/room/join), then send its token as X-Room-Token",
                           code="not_joined")
        return member

    @app.get("/api/room/me")
    async def me(request: Request):
        member = member_of(request)
        return {"label": member.label, "slot": room.slots.get(member.label), "rids": list(member.rids)}

    @app.post("/api/room/leave")
    async def leave(request: Request):
        member = room.leave(member_of(request).token)
        return {"left": member.label}

    @app.post("/api/room/chat")
    async def chat(request: Request):
        member = member_of(request)
        body = await read_json(request, cfg.max_body_bytes)
        text = body.get("text") if isinstance(body, dict) else None
        problem = check_message(text if isinstance(text, str) else None, "en")
        if problem:
            raise APIError(400, problem, param="text")
        if member.busy:
            raise APIError(409, "your previous reply is still streaming; wait for it to finish", code="busy")
        messages = member.history[-2 * HISTORY_TURNS:] + [{"role": "user", "content": text}]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.6, top_p=0.9)
        # the student's own bucket, not their address: a room behind one NAT shares that
        client = client_of(request.headers, request.client.host if request.client else None,
                           identity=f"room:{member.label}")
        try:
            stream = await service.submit(messages=messages, params=params, label=member.label, client=client)
        except Exception as e:
            error = admission_error(e, "text")
            if error is None:
                raise
            raise error from None
        member.rids.append(stream.id)
        member.busy, member.stream = True, stream

        def done():
            stream.close()                  # aborts the request unless it has ended
            member.busy, member.stream = False, None

        async def lines():
            reply, error = "", None
            try:
                yield json.dumps({"rid": stream.id, "label": member.label}) + "\n"
                async with stream:
                    async for delta in stream:
                        reply += delta.text
                        error = delta.error or error
                        if delta.text:
                            yield json.dumps({"text": delta.text}) + "\n"
                yield json.dumps({"error": error} if error else {"done": stream.finish_reason}) + "\n"
                if not error:
                    turn = [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
                    member.history = (member.history + turn)[-2 * HISTORY_TURNS:]
            finally:
                done()
        return AbortOnDisconnect(Lines(lines(), done), media_type="application/x-ndjson",
                                 headers={"Cache-Control": "no-cache"})
