"""A lesson played through a tab's chat panels: its passes, each under the setting it sets (run), and
its scripted users (play), from an app/replay/scenarios.py Scenario.

A lesson plays on the engine one at a time: one pressed in any tab stops the one playing (its Stage),
and one pressed again in a tab stops that tab's earlier lesson; a tab without the presenter key plays
the scenario under the settings in force and stops only its own. The lesson on the engine tells every
viewer when it starts and ends (a "lesson" message in the record stream, `announcement`): the projector
and the students' pages name it over their chart.

Each distinct label of the scenario takes a panel (a panel of the same name
if there is one, else the next free one), so the lecturer sees the scripted
users type and the chart shows them in their panel's colour. Arrivals on the
"step" clock are timed by the step records the engine publishes; when a
record says the engine has run out of work, the next arrival comes at once.
Those records reach this event loop late on a busy machine, so the runner
also holds the engine at the step its next user is due (EngineLoop.hold):
the user joins the step the scenario names, and a lesson's steps are the
same on a loaded machine as on an idle one.
The arrivals fall due through app/replay/play.py's Replay, as in demos/compare/runner.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

from app.readers import metrics
from app.replay.play import Replay
from app.replay.scenarios import LESSONS, Arrival, Lesson, Scenario
from app.ui.sessions import Panel, ScriptedRun, Session, Stage, Turn, drive, fresh, stream_all
from app.ui.text import setting_line, t
from engine.errors import ServiceUnavailable

SHOWN_CHARS = 220           # a long scripted prompt is shown shortened in its panel
STOPPED = "another lesson was started"   # the abort reason of a stopped lesson's replies

# The note under the lesson strip, said in a given language: the tab keeps the last one (Session.note),
# so a switch of language says it again in the new one.
Note = Callable[[str], str]


def silent(lang: str) -> str:
    return ""


def say(key: str, **fields) -> Note:
    """The note app/ui/text.py's `key` says, with fields that read the same in every language."""
    return lambda lang: t(lang, key, **fields)


def in_force(change: dict) -> Note:
    """The settings a lesson's pass set (POST /api/engine's fields), each said in the note's language."""
    return lambda lang: t(lang, "in_force", setting=setting_line(lang, change))


def joined(*notes: Note) -> Note:
    return lambda lang: "\n\n".join(note(lang) for note in notes)


def announcement(k: int, lesson: Lesson, event: str) -> dict:
    """The stream's message that lesson k (from 1) `started`, `ended` (played to its end) or `stopped`
    (cancelled, or its setting refused; one replaced by a newer lesson says nothing: the newer one starts).
    `text`: its words' key in the page's strings (`page.<text>`, `{k}` in them its number)."""
    return {"type": "lesson", "event": event, "lesson": k, "text": lesson.text_key(k)}


def shorten(text: str) -> str:
    if len(text) <= SHOWN_CHARS:
        return text
    head = " ".join(text[:SHOWN_CHARS].split())
    return f"{head} … (+{len(text) - SHOWN_CHARS:,} characters)"


def assign_panels(session: Session, scenario: Scenario) -> dict[str, Panel]:
    """label -> panel: same name first, then free panels in order; more than eight labels share."""
    by_name = {p.name.lower(): p for p in session.panels}
    labels = list(dict.fromkeys(a.label for a in scenario.arrivals))
    out: dict[str, Panel] = {label: by_name[label.lower()] for label in labels if label.lower() in by_name}
    free = [p for p in session.panels if p not in out.values()]
    for i, label in enumerate(x for x in labels if x not in out):
        out[label] = free[i % len(free)] if free else session.panels[i % len(session.panels)]
    used = max(session.panels.index(p) for p in out.values()) + 1
    session.visible = max(session.visible, min(used, len(session.panels)))
    return out


async def run(service, s: Session, scenario: Scenario, lesson: Lesson | None, policies: tuple[str, ...],
              allowed: bool, stage: Stage):
    """Play `scenario` in tab `s`, once per policy, one pass after the other, each under the full setting
    its lesson sets for it (app/replay/scenarios.py Lesson.setting); without the presenter key (`allowed`
    False) or policies, once under the settings in force. Before each pass the prefix cache is emptied,
    so the pass finds no earlier chat's blocks and runs as it does alone. Yields the note to show under
    the lesson strip (a Note) each time the panels have changed. `stage`: the engine's (see the module's
    text)."""
    note = silent if allowed or not policies else say("locked")
    sets = allowed and lesson is not None
    number = LESSONS.index(lesson) + 1 if sets and lesson in LESSONS else 0   # told to every viewer
    me = ScriptedRun()
    s.stopped = 0
    played = False
    try:
        await s.playing.take(me)            # the tab's earlier lesson stops first: nothing of it runs on
        if sets:                            # and the engine's, whichever tab plays it: this one sets it
            await stage.take(me)
        if number:
            service.announce(announcement(number, lesson, "started"))
        passes = []
        for index, policy in enumerate(policies if allowed and policies else (None,)):
            if me.stop.is_set():            # a newer lesson was pressed
                break
            if sets:
                change = lesson.setting(scenario, policy, service.config.step_delay, index)
                try:
                    await service.set_policy(**change)
                except (ValueError, ServiceUnavailable) as e:
                    # refused, all of it (a reply under way needs more KV than the lesson's cap, say: the
                    # engine's message names it), or no engine: the lesson says why and starts nothing more
                    yield say("lesson_refused", why=e)
                    return
                if hasattr(service, "reset_prefix_cache"):
                    await service.reset_prefix_cache()
                note = in_force(change)
                if policy == "disaggregated":
                    yield say("pair_starting")
                    if problem := await pair_ready(service, me.stop):
                        yield problem
                        return
                    if me.stop.is_set():
                        break
            changed = asyncio.Event()
            before = {id(turn) for p in s.panels for turn in p.turns}
            async for _ in stream_all([play(service, s, scenario, changed, s.lang, me.stop)], changed, lambda: None):
                yield note
            passes.append({turn.rid for p in s.panels for turn in p.turns if id(turn) not in before and turn.rid})
        if me.stop.is_set() and s.playing.run is me:
            # stopped by a lesson pressed in another tab (one pressed here draws this tab itself): the
            # note of the settings this lesson set is no longer true, nor is its caption
            s.stopped = number              # only a lesson that set the engine's stage is stopped by another tab
            yield say("lesson_stopped")
            return
        played = not me.stop.is_set()
        if sets and lesson.speculative and len(passes) == 2 and played:
            _, stream = service.ring.last_steps(service.config.history)
            yield joined(note, speculation_result(stream, *passes))
    finally:
        s.playing.end(me)
        stage.end(me)
        if number and not me.stop.is_set():     # a newer lesson took over: it announces itself
            service.announce(announcement(number, lesson, "ended" if played else "stopped"))


async def pair_ready(service, stop: asyncio.Event, timeout: float = 600.0) -> Note | None:
    """Wait until the prefill and decode workers are loaded and in force (the first switch starts
    them: two model copies), or `stop` is set; None then, else a note saying why not."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline and not stop.is_set():
        state = await service.engine_state()
        if state.get("policy") == "disaggregated":
            return None
        if str(state.get("disaggregated") or "").startswith("failed"):
            return say("pair_failed", why=state["disaggregated"])
        await asyncio.sleep(0.5)
    return None if stop.is_set() else say("pair_failed", why=f"not ready after {timeout:.0f} s")


def speculation_result(stream: list[dict], off: set[str], on: set[str]) -> Note:
    """The speculative lesson's two numbers, from its records: mean time between tokens without and with
    speculation, at 1 stream and at the most streams both passes decoded at once; and the acceptance rate."""
    a, b = metrics.tbt_by_streams(stream, off), metrics.tbt_by_streams(stream, on)
    mine = [r for r in metrics.steps(stream) if any(it["req"] in on for it in r["items"])]
    rate = metrics.acceptance_rate(*metrics.drafts(mine))
    shared = sorted(set(a) & set(b))
    if not shared or rate is None:
        return say("spec_result_none")
    ms = lambda v: f"{v * 1000:.0f} ms"
    n = shared[-1]
    return say("spec_result", one_off=ms(a[shared[0]]), one_on=ms(b[shared[0]]), lo=shared[0], n=n,
             n_off=ms(a[n]), n_on=ms(b[n]), rate=f"{rate * 100:.0f} %")


async def play(service, session: Session, scenario: Scenario, changed: asyncio.Event, lang: str,
               stop: asyncio.Event | None = None):
    """Send the scenario's users as they fall due, each through its panel, until every reply has ended.
    `stop` set (a newer lesson pressed in the tab): no more users are sent and the replies under way are
    aborted (leaving their streams aborts them, in order before anything the caller posts next)."""
    panels = assign_panels(session, scenario)
    loop = asyncio.get_running_loop()
    children: list[asyncio.Future] = []
    clock = StepClock(service.broadcaster.subscribe(0), children) if scenario.clock == "step" else None
    # held: our own engine (an attached vLLM cannot be), unless the pair is in force, whose workers step
    # on their own (holding the loop would only stop their records); else the records are counted
    hold = (clock is not None and hasattr(service, "hold")
            and (await service.engine_state()).get("policy") != "disaggregated")
    key = object()                          # this lesson's hold
    turns: list[Turn] = []

    def send(a: Arrival) -> Turn:
        # a plain prompt goes in as it is (no chat template), so it has the scenario's exact token count
        messages = [dict(m) for m in a.messages] if a.messages else [{"role": "user", "content": a.prompt}]
        text = messages[-1]["content"] = fresh(messages[-1]["content"])
        panel = panels[a.label]
        turn = Turn(shown=shorten(text), full=text)
        panel.turns.append(turn)
        turns.append(turn)
        job = drive(service, panel, turn, None if a.prompt is not None else messages, a.params(), changed, lang,
                    prompt=text if a.prompt is not None else None, held_by=key if hold else None)
        children.append(asyncio.ensure_future(job))
        return turn

    try:
        replay, start = Replay(scenario), loop.time()
        if hold:
            clock.first = await service.hold(key, 0)       # held now; steps are counted from the next one
        while not replay.done:
            if clock is None:
                if await unless(stop, asyncio.sleep(max(0.0, start + replay.next_at - loop.time()))):
                    return
            else:       # back from waiting: the step has come, or the engine went idle (skip ahead, as demos does)
                if hold:
                    await service.hold(key, clock.first + math.ceil(replay.next_at))
                if await unless(stop, clock.wait_until(replay.next_at)):
                    return
                clock.skip_to(replay.skip_idle(clock.steps))
            sent = [send(a) for _, a in replay.due(clock.steps if clock else 0, loop.time() - start)]
            if clock is not None:
                clock.idle = False              # the engine has work now, whatever the last record said
            changed.set()
            while hold and not all(t.rid is not None or t.done for t in sent):
                await asyncio.sleep(0.002)      # in the engine (or refused) before the hold moves on
        if hold:
            service.let_go(key)
        # asyncio.wait, not gather: a stop must not cancel the replies before they are aborted with the reason
        if children and not await unless(stop, asyncio.wait(children)):
            for c in children:
                c.result()                      # a bug in a reply's job must not pass silently
    finally:
        if hold:
            service.let_go(key)
        if clock is not None:
            clock.sub.close()
        if stop is not None and stop.is_set():  # the replies it ends say why (the streams' own close does not)
            for turn in turns:
                if turn.rid is not None and not turn.done:
                    service.abort(turn.rid, STOPPED)
        for c in children:
            c.cancel()
        await asyncio.gather(*children, return_exceptions=True)


async def unless(stop: asyncio.Event | None, aw) -> bool:
    """Await `aw`, unless `stop` is set first: then `aw` is cancelled and the answer is True."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        await task
        return False
    halt = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        task.cancel()                       # nothing, once it has ended
    with contextlib.suppress(asyncio.CancelledError):
        await task                          # its error, if it raised
    return task.cancelled()


class StepClock:
    """Counts the engine's steps from the records it publishes, and knows when it has gone idle.
    first: the number of the scenario's first step when the lesson holds the engine (steps are then
    read off the records' numbers), else None (the records are counted as they come)."""

    def __init__(self, sub, children: list):
        self.sub, self.children = sub, children
        self.steps = 0
        self.first: int | None = None
        self.idle = True                    # nothing of ours has been sent yet

    def skip_to(self, steps: int):
        """The engine went idle: the scenario jumps ahead to `steps`, and the next step is that one."""
        if self.first is not None:
            self.first -= steps - self.steps
        self.steps = steps

    async def wait_until(self, target: float):
        while self.steps < target and not self.idle:
            try:
                items = await asyncio.wait_for(self.sub.get(), timeout=2.0)
            except asyncio.TimeoutError:
                # a slow step, or nothing will come: our requests all ended (e.g. refused)
                if all(c.done() for c in self.children):
                    return
                continue
            if items is None:
                return
            for x in items:
                rec = getattr(x, "obj", x)
                if rec.get("type") != "step" or (self.first is not None and rec["step"] < self.first):
                    continue                # not a step, or one from before the lesson began
                self.steps = self.steps + 1 if self.first is None else max(self.steps, rec["step"] - self.first + 1)
                self.idle = rec.get("running", 0) + rec.get("waiting", 0) == 0
