"""Scripted users join the step their scenario names, however loaded the machine.

The lesson runner (app/ui/lessons.py) counts the engine's steps from the records it publishes, but
those reach its event loop late when the machine is busy: meanwhile the engine, stepping without
pause, has gone on. The runner therefore holds the engine at the step its next user is due (the
engine loop starts no later step until the hold moves), so the step-for-step shape of a lesson is
the same on a loaded machine as on an idle one. This test makes the event loop slow on purpose.
"""
import asyncio
import time

from app.replay.scenarios import Arrival, Scenario
from tests.helpers import recording

GROUP = 6           # users who arrive together at step 0 (with the two late ones: one panel each)
LATE = (3, 5)       # then one user at each of these steps


def scenario() -> Scenario:
    arrivals = [Arrival(0, f"u{i}", max_tokens=12, prompt=f"hello number {i}") for i in range(GROUP)]
    arrivals += [Arrival(at, f"late{at}", max_tokens=4, prompt=f"late at {at}") for at in LATE]
    return Scenario("clock-test", "six at once, then one at each of two later steps", tuple(arrivals))


def who(prompt: str) -> str:
    for i in range(GROUP):
        if f"hello number {i}" in prompt:
            return f"u{i}"
    return next(f"late{at}" for at in LATE if f"late at {at}" in prompt)


def test_scripted_users_join_their_step_while_the_event_loop_is_slow(tiny_model):
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui import lessons
    from app.ui.sessions import Session
    from engine import EngineConfig

    service = EngineService(EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.25),
                            ServerConfig(step_delay=0.0))       # the engine never waits for the runner
    service.start()
    records, session = [], Session()

    async def main():
        async def busy():                   # a loaded machine: the event loop answers 30 ms late
            while True:
                time.sleep(0.03)
                await asyncio.sleep(0)
        async with recording(service, records):
            hog = asyncio.ensure_future(busy())
            await lessons.play(service, session, scenario(), asyncio.Event(), "en")
            hog.cancel()
            await asyncio.sleep(0.2)

    try:
        asyncio.run(main())
        free = service.loop.holds           # the runner let go of the engine when it finished
    finally:
        service.stop()
    assert free == {}
    label = {t.rid: who(t.full) for p in session.panels for t in p.turns}   # rid -> the arrival it was
    ours = [r for r in records if r["type"] == "step" and any(i["req"] in label for i in r["items"])]
    first = ours[0]
    assert {label[i["req"]] for i in first["items"]} == {f"u{i}" for i in range(GROUP)}, "the group was split"
    for at in LATE:
        joined = next(r for r in ours if any(label.get(i["req"]) == f"late{at}" for i in r["items"]))
        assert joined["step"] - first["step"] == at, (at, joined["step"] - first["step"])
    assert all(t.done and not t.error for p in session.panels for t in p.turns)


def test_a_hold_stops_steps_until_it_moves_and_one_nobody_moves_is_dropped(tiny_model, monkeypatch):
    from app.config import ServerConfig
    from app.serving import engine_loop
    from app.serving.service import EngineService
    from engine import EngineConfig, SamplingParams

    monkeypatch.setattr(engine_loop, "HOLD_LIMIT_S", 1.0)
    service = EngineService(EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.25),
                            ServerConfig(step_delay=0.0))
    service.start()

    async def reply(key):
        stream = await service.submit(prompt="held", params=SamplingParams(max_tokens=3, ignore_eos=True),
                                      held_by=key)
        n = 0
        async with stream:
            async for delta in stream:
                n += len(delta.token_ids)
        return n

    async def main():
        key = object()
        at = await service.hold(key, 0)                 # held before the next step
        job = asyncio.ensure_future(reply(key))
        await asyncio.sleep(0.4)
        assert service.engine.step_index == at and not job.done()   # commands ran, no step did
        await service.hold(key, at + 2)                 # two steps, then held again
        await asyncio.sleep(0.4)
        assert service.engine.step_index == at + 2 and not job.done()
        service.let_go(key)
        assert await asyncio.wait_for(job, 10) == 3
        # a hold nobody moves: the engine runs again after HOLD_LIMIT_S
        stuck = object()
        await service.hold(stuck, service.engine.step_index)
        t0 = time.monotonic()
        assert await asyncio.wait_for(reply(stuck), 10) == 3
        return time.monotonic() - t0

    try:
        waited = asyncio.run(main())
    finally:
        service.stop()
    assert 0.9 < waited < 5 and service.loop.holds == {}


def test_a_hold_never_stalls_a_reply_that_no_holder_added(tiny_model, monkeypatch):
    """A lesson pressed while the room chats: the students' replies go on, the lesson's users join late."""
    from app.config import ServerConfig
    from app.serving import engine_loop
    from app.serving.service import EngineService
    from engine import EngineConfig, SamplingParams

    monkeypatch.setattr(engine_loop, "HOLD_LIMIT_S", 30.0)
    service = EngineService(EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.25),
                            ServerConfig(step_delay=0.0))
    service.start()

    async def reply(held_by=None, n=3):
        stream = await service.submit(prompt="room", params=SamplingParams(max_tokens=n, ignore_eos=True),
                                      held_by=held_by)
        got = 0
        async with stream:
            async for delta in stream:
                got += len(delta.token_ids)
        return got

    async def main():
        key = object()
        at = await service.hold(key, 0)
        lesson = asyncio.ensure_future(reply(key, 40))
        await asyncio.sleep(0.3)
        assert service.engine.step_index == at and not lesson.done()     # the lesson's own user waits
        t0 = time.monotonic()
        assert await asyncio.wait_for(reply(None), 10) == 3               # a student's does not
        waited = time.monotonic() - t0
        service.let_go(key)
        assert await asyncio.wait_for(lesson, 20) == 40
        return waited

    try:
        waited = asyncio.run(main())
    finally:
        service.stop()
    assert waited < 5 and service.loop.holds == {} and service.loop.held_rids == {}


def test_unless_cancels_what_a_stop_interrupts_and_passes_on_the_rest():
    """app/ui/lessons.py's unless(stop, aw): the waits a stopped lesson leaves (its clock, its replies)."""
    from app.ui.lessons import unless

    async def main():
        ran = []

        async def job(seconds, fail=False):
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                ran.append("cancelled")
                raise
            if fail:
                raise RuntimeError("broken")
            ran.append("done")
        stop = asyncio.Event()
        assert await unless(None, job(0)) is False and await unless(stop, job(0)) is False
        asyncio.get_running_loop().call_later(0.05, stop.set)
        assert await unless(stop, job(5)) is True              # stopped while it waited
        assert await unless(stop, job(5)) is True              # already stopped: it never waits
        try:
            await unless(asyncio.Event(), job(0, fail=True))
        except RuntimeError as e:
            assert str(e) == "broken"
        else:
            raise AssertionError("its error was lost")
        return ran
    assert asyncio.run(main()) == ["done", "done", "cancelled", "cancelled"]
