"""Chat panels of one browser tab, and the coroutines that stream their replies.

A tab has up to eight panels (Alice, Bob, ...). Several Gradio events may
stream into the same panel at once (its own Send, "send to all", a
scenario), so the truth lives here, in one Session per tab, and every event
renders the panels it touches from it. Everything runs on the server's
event loop: no locks needed.
"""
from __future__ import annotations

import asyncio
import contextlib
import html
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from app.serving.service import QueueFull, ServiceUnavailable
from app.ui.text import USERS, t
from engine import SamplingParams

MAX_CHARS = 20_000          # a typed message longer than this is refused before tokenising
RENDER_EVERY = 0.08         # s between two renders of a streaming event (the chart has its own stream)
LONG_PROMPT = 2_000         # characters: a prompt this long is numbered by fresh()
_serial = itertools.count(1)


def fresh(text: str) -> str:
    """Number a long prompt, so that a demo run twice is prefilled twice.

    The prefix cache would otherwise serve the second copy of the same
    document from cache, and the prefill (and its stall) would not show.
    The number has a fixed width, so every copy is the same number of tokens
    and a lesson's steps are the same however often it has run.
    """
    return f"(#{next(_serial) % 10_000:04d}) {text}" if len(text) >= LONG_PROMPT else text


@dataclass
class Turn:
    shown: str                      # what the panel shows as the user's message
    full: str                       # what the engine receives
    reply: str = ""
    error: str | None = None
    rid: str | None = None
    done: bool = False
    ended: int | None = None        # under ignore_eos: len(reply) where the model sampled its end token; the
                                    # rest is the model going on past its own end (a lesson's fixed length)

    @property
    def own_reply(self) -> str:
        """The reply the model meant: up to its end token."""
        return self.reply if self.ended is None else self.reply[:self.ended]


@dataclass
class Panel:
    name: str
    color: str
    turns: list[Turn] = field(default_factory=list)
    notice: str = ""                # a friendly error or note under the panel, as plain text

    def messages(self, new: str) -> list[dict]:
        """The chat history the engine sees for a new message: earlier complete turns, then it."""
        out = []
        for turn in self.turns:
            if turn.done and not turn.error and turn.reply:
                out += [{"role": "user", "content": turn.full}, {"role": "assistant", "content": turn.own_reply}]
        return out + [{"role": "user", "content": new}]

    def chat(self, lang: str = "en") -> list[dict]:
        """The Chatbot value (messages format). Escaped: the Chatbot renders HTML, and what people type
        (and what the model answers) must show as the text it is. A reply run past the model's end says
        where the model ended."""
        out = []
        for turn in self.turns:
            out.append({"role": "user", "content": html.escape(turn.shown)})
            reply = turn.reply or ("" if turn.done else "…")
            if turn.ended is not None:
                reply = "\n\n".join((turn.own_reply, t(lang, "past_eos"), turn.reply[turn.ended:]))
            if turn.error:
                reply = (reply + "\n\n" if reply else "") + f"⚠ {turn.error}"
            out.append({"role": "assistant", "content": html.escape(reply)})
        return out


class Session:
    def __init__(self):
        self.panels = [Panel(name, color) for name, color in USERS]
        self.visible = 4
        self.lang = "en"
        self.touched = time.monotonic()
        self.playing = Stage()                    # the lesson or scenario the tab is playing
        self.stopped = 0        # the lesson (its number) that one pressed in another tab stopped here, else 0
        self.note = None        # the note under the lesson strip (app/ui/lessons.py Note), said in any language

    def request_ids(self) -> list[str]:
        """This tab's recent request ids, newest last (the sparklines show only these)."""
        ids = [turn.rid for p in self.panels for turn in p.turns[-6:] if turn.rid]
        return ids[-64:]


@dataclass
class ScriptedRun:
    """A lesson or scenario playing: `stop` is set when a newer one replaces it, `done` once it has stopped
    (its replies ended)."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Stage:
    """Where one scripted run plays at a time: each tab has one (Session.playing), and so has the engine for
    the runs that change its settings (UI.stage: a lecturer's second tab, say the projector's, shares the
    engine with the first, so a lesson pressed in either stops the one playing in the other)."""

    def __init__(self):
        self.run: ScriptedRun | None = None

    async def take(self, run: ScriptedRun):
        """Make `run` the one playing here. A run still going is stopped first, and awaited: its users not yet
        due are never sent and its replies under way are aborted (app/ui/lessons.py), so none of it shares
        the new run's steps or stands in the way of its settings. The caller ends `run` with end, however it
        ends (a finally)."""
        earlier, self.run = self.run, run
        if earlier is not None:
            earlier.stop.set()
            await earlier.done.wait()

    def end(self, run: ScriptedRun):
        run.done.set()
        if self.run is run:
            self.run = None


class Sessions:
    """One Session per browser tab, by Gradio's session hash; the least recently used go first."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._by_hash: OrderedDict[str, Session] = OrderedDict()

    def get(self, key: str | None) -> Session:
        key = key or "-"
        s = self._by_hash.pop(key, None) or Session()
        s.touched = time.monotonic()
        self._by_hash[key] = s
        while len(self._by_hash) > self.capacity:
            self._by_hash.popitem(last=False)
        return s

    def drop(self, key: str | None):
        self._by_hash.pop(key or "-", None)


def check_message(text: str | None, lang: str) -> str | None:
    """A friendly reason to refuse a typed message, or None."""
    if text is None or not text.strip():
        return t(lang, "err_empty")
    if len(text) > MAX_CHARS:
        return t(lang, "err_chars", n=len(text), limit=MAX_CHARS)
    return None


async def drive(service, panel: Panel, turn: Turn, messages: list[dict] | None, params: SamplingParams,
                changed: asyncio.Event, lang: str, client: str | None = None, prompt: str | None = None,
                held_by: object | None = None):
    """Submit one turn and stream its reply into it. Errors end up in the turn, as text.
    client: the browser's address, for the per-client rate limit (scripted scenarios pass None).
    prompt: a plain prompt instead of messages (no chat template: a scenario's exact token count).
    held_by: the scripted lesson's hold the request belongs to (only with our own engine)."""
    try:
        chat = {"prompt": prompt} if prompt is not None else {"messages": messages}
        held = {"held_by": held_by} if held_by is not None else {}
        stream = await service.submit(**chat, params=params, label=panel.name, client=client, **held)
    except ValueError as e:
        turn.error = t(lang, "err_long", msg=str(e))
    except QueueFull as e:
        turn.error = t(lang, "err_busy", msg=str(e))
    except ServiceUnavailable as e:
        turn.error = t(lang, "err_down", msg=str(e))
    else:
        turn.rid = stream.id
        changed.set()
        # the end token adds no text: the text after it rides on the same output
        ends = service.eos_token_ids if params.ignore_eos else frozenset()
        async with stream:
            async for delta in stream:
                if turn.ended is None and not ends.isdisjoint(delta.token_ids):
                    turn.ended = len(turn.reply)
                turn.reply += delta.text
                if delta.error:
                    turn.error = t(lang, "err_reply", msg=delta.error)
                changed.set()
    finally:
        turn.done = True
        changed.set()


async def stream_all(jobs: list, changed: asyncio.Event, render):
    """Run the drive() coroutines in `jobs` together; yield render() as they progress.

    If the event is cancelled (the tab closed, Stop pressed) the tasks are
    cancelled too, and leaving their streams aborts the requests in the engine.
    """
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        yield render()
        while not all(task.done() for task in tasks):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=1.0)
            changed.clear()
            yield render()
            await asyncio.sleep(RENDER_EVERY)
        yield render()
        for task in tasks:
            task.result()                   # a bug in a job must not pass silently
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
