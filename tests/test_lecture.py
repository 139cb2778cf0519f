"""A whole lecture: every lesson in order, then lesson 3 again; and the cache lessons after others.

Each lesson must set everything it needs and leave nothing behind, so its steps come out the
same whatever ran before it: every pass is compared, step by step, with the same lesson run
alone on a fresh server. A step's shape is what it computed for whom (label, kind, tokens),
never its wall time. Tokens served from the prefix cache count with the chunk that starts
after them: a chat question an earlier lesson asked is cached (the cache is the engine's to
keep), but the step that reads the rest of the prompt is the same step.

The disaggregated pass of lesson 5 runs on two worker processes whose steps interleave by
time, so it is compared by what each worker computed for each user, not step by step.

What is compared is scheduling, never text: every reply runs to its scenario's max_tokens (ignore_eos) and
prompts are counted by the default tokenizer, so the lessons run on the tiny random model (the browser
lesson tests play them on the real one).
"""
import asyncio
from collections import Counter

import pytest

from app.replay.scenarios import LESSONS, SETTING_KEYS, get_scenario
from app.ui.text import t
from tests.helpers import recording

# the lessons' own speed knobs (shorter replies, the document early); no pause between steps: the
# lesson runner holds the engine at the step each scripted user is due (tests/test_lesson_clock.py)
FAST = {"static-vs-continuous": dict(reply_tokens=(2, 7, 3, 5, 2, 8, 1, 4)),
        "long-prompt-interrupts": dict(reply_tokens=8, doc_tokens=2, doc_at=6),
        "budget-shapes": dict(reply_tokens=4),
        "split-prefill-decode": dict(reply_tokens=8, doc_tokens=2, doc_at=6),
        "speculative-room": dict(reply_tokens=48, room_at=6, room_tokens=24),
        "shared-system-prompt": dict(reply_tokens=4, every=3),
        "memory-pressure": dict(reply_tokens=40)}        # still past lesson 7's KV cap: preemptions happen
STEP_DELAY = 0.0


class Tab:
    def __init__(self, name: str):
        self.session_hash = name


async def drain(run, notes: list | None = None):
    """Play a lesson's run_scenario to its end; the notes it showed, in order, into `notes`."""
    async for out in run:
        if notes is not None:
            notes.append(out[-1])


def start_service(model: str, params: dict = FAST, presenter_key: str | None = None):
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui.page import UI
    from engine import EngineConfig
    service = EngineService(EngineConfig(model=model, dtype="float32", kv_cache_gb=0.25),
                            ServerConfig(step_delay=STEP_DELAY, presenter_key=presenter_key))
    service.start()
    return service, UI(service, scenario_params=params)


def run_lessons(order: list[int], model: str, params: dict = FAST) -> list[dict]:
    """Play lessons (1-based) in order on one fresh server; per lesson, its passes' records."""
    service, ui = start_service(model, params)
    records: list[dict] = []

    async def main():
        runs = []
        async with recording(service, records):
            for n, k in enumerate(order):
                lesson, tab = LESSONS[k - 1], Tab(f"lesson-{n}")
                start = len(records)
                async for _ in ui.run_scenario(lesson.scenario, lesson.policies, "", tab, lesson):
                    pass
                await asyncio.sleep(0.3)            # the last records reach the collector
                rids = {t.rid for p in ui.sessions.get(tab.session_hash).panels for t in p.turns if t.rid}
                runs.append({"lesson": k, "rids": rids, "records": records[start:]})
        return runs

    try:
        return asyncio.run(main())
    finally:
        service.stop()


def passes(run: dict) -> list[tuple[dict, list[dict]]]:
    """(the policy event that opened the pass, the pass's steps) for each pass of a lesson run."""
    out = []
    for r in run["records"]:
        if r["type"] == "policy":
            out.append((r, []))
        elif r["type"] == "step" and out and any(i["req"] in run["rids"] for i in r["items"]):
            out[-1][1].append(r)
    return [(event, steps) for event, steps in out if steps]


def shape(step: dict) -> tuple:
    return tuple(sorted((i["label"], i["kind"], i["tokens"] + i.get("cached", 0)) for i in step["items"]))


def per_worker(steps: list[dict]) -> Counter:
    out = Counter()
    for s in steps:
        for i in s["items"]:
            out[(s.get("worker"), i["label"], i["kind"])] += i["tokens"] + i.get("cached", 0)
    return out


def test_every_lesson_then_three_again_each_as_if_alone(tiny_model):
    check_as_if_alone([*range(1, len(LESSONS) + 1), 3], str(tiny_model))


def test_the_cache_lessons_after_others_run_as_if_alone(tiny_model):
    """Lesson 6 after a chat lesson (whose template block it would hit) and after itself; lesson 7 after 6,
    whose caching it must switch off, and after itself, whose cap the next lesson must lift."""
    six = next(k for k, x in enumerate(LESSONS, 1) if x.scenario == "shared-system-prompt")
    seven = next(k for k, x in enumerate(LESSONS, 1) if x.scenario == "memory-pressure")
    runs = check_as_if_alone([3, six, six, seven, seven, 3], str(tiny_model))
    capped = [steps for run in runs if run["lesson"] == seven for event, steps in passes(run)
              if event["max_kv_blocks"]]
    assert capped and all(any(s["preempted"] for s in steps) for steps in capped), "lesson 7 preempted nobody"
    cached = [sum(i.get("cached", 0) for s in steps for i in s["items"]) for run in runs if run["lesson"] == six
              for event, steps in passes(run)]
    assert cached[0] > 0 and cached[1] == 0 and cached[2] == cached[0], cached   # on, off; on again, as alone


def check_as_if_alone(order: list[int], model: str) -> list[dict]:
    lecture = run_lessons(order, model)
    alone = {k: run_lessons([k], model)[0] for k in sorted(set(order))}
    for run in lecture:
        k, lesson = run["lesson"], LESSONS[run["lesson"] - 1]
        got, want = passes(run), passes(alone[k])
        assert [e["policy"] for e, _ in got] == list(lesson.policies), (k, [e["policy"] for e, _ in got])
        # every viewer was told which lesson played: its start before its first setting, then its end
        told = [(r["event"], r["lesson"], r["text"]) if r["type"] == "lesson" else "policy"
                for r in run["records"] if r["type"] in ("lesson", "policy")]
        assert told[0] == ("started", k, lesson.text_key(k)) and told[-1] == ("ended", k, lesson.text_key(k)), told
        assert sum(x != "policy" for x in told) == 2, told
        assert len(want) == len(got)
        for index, ((event, steps), (_, ref)) in enumerate(zip(got, want)):
            # the setting in force is the lesson's, all of it (the chunk cap of lesson 4 included)
            setting = {key: event[key] for key in SETTING_KEYS}
            assert setting == ui_setting(lesson, event["policy"], index), (k, setting)
            if event["policy"] == "disaggregated":
                assert per_worker(steps) == per_worker(ref), k
                assert {s.get("worker") for s in steps} == {"prefill", "decode"}
            else:
                assert [shape(s) for s in steps] == [shape(s) for s in ref], (k, event["policy"])
    return lecture


def ui_setting(lesson, policy: str, index: int = 0) -> dict:
    from app.replay.scenarios import get_scenario
    return lesson.setting(get_scenario(lesson.scenario, **FAST[lesson.scenario]), policy, STEP_DELAY, index)


def test_the_speculative_lesson_after_another_runs_as_alone_and_leaves_speculation_off(tiny_model):
    """The speculative lesson (speculation off, then on) after lesson 1 takes the same steps as alone, drafts in
    its second pass only, and lesson 3 after it runs as alone: nothing of its speculation stays behind."""
    k = next(n for n, x in enumerate(LESSONS, 1) if x.scenario == "speculative-room")
    lecture = run_lessons([1, k, 3], str(tiny_model))
    alone = {n: run_lessons([n], str(tiny_model))[0] for n in (k, 3)}
    for run in lecture[1:]:
        got, want = passes(run), passes(alone[run["lesson"]])
        assert [[shape(s) for s in steps] for _, steps in got] == [[shape(s) for s in steps] for _, steps in want]
    (off, off_steps), (on, on_steps) = passes(lecture[1])
    assert off["speculative_config"] is None and on["speculative_config"]["num_speculative_tokens"] == 3
    assert not any(i.get("drafted") for s in off_steps for i in s["items"])
    assert any(i.get("drafted") for s in on_steps for i in s["items"])
    assert passes(lecture[2])[0][0]["speculative_config"] is None


def test_a_lesson_refused_by_a_live_request_says_why_and_the_request_goes_on(tiny_model):
    """Lesson 7 caps the KV cache; a reply already under way that needs more than the cap on its own (a
    student's long chat, or the lesson still running before it) makes the engine refuse that setting. The
    lesson says so in its note, naming the request, and starts nothing; the reply runs to its end (600 tokens:
    seconds on the tiny model, against the milliseconds the lesson takes to ask)."""
    from engine import SamplingParams
    seven = next(x for x in LESSONS if x.scenario == "memory-pressure")
    service, ui = start_service(str(tiny_model))

    async def main():
        long = await service.submit(prompt_token_ids=[(17 * i + 5) % 4000 + 100 for i in range(420)],
                                    params=SamplingParams(max_tokens=600, ignore_eos=True), label="long")
        before = await service.engine_state()
        notes = [out[-1] async for out in ui.run_scenario(seven.scenario, seven.policies, "", Tab("t7"), seven)]
        after = await service.engine_state()
        async for last in long:
            pass
        return notes, before, after, last.num_output_tokens, last

    try:
        notes, before, after, tokens, last = asyncio.run(main())
    finally:
        service.stop()
    assert notes and "max_kv_blocks=24" in notes[-1] and "'r0'" in notes[-1], notes
    assert notes[-1].startswith(t("en", "lesson_refused", why="")[:20]), notes[-1]
    assert not [p for p in ui.sessions.get("t7").panels for turn in p.turns], "the refused lesson sent nothing"
    assert after["max_kv_blocks"] == before["max_kv_blocks"] is None and after["policy"] == before["policy"]
    assert tokens == 600 and last.finish_reason == "length"


@pytest.mark.parametrize("when, where", [("its first user is in", "the same tab"),
                                         ("all its users are in", "the same tab"),
                                         ("all its users are in", "another tab")])
def test_a_lesson_pressed_while_another_runs_stops_it_and_runs_as_if_alone(tiny_model, when, where):
    """The lecturer presses lesson 3 while lesson 2 still runs, with its document still to come or with every
    user in, in the same tab or in a second one on the same engine (the projector's): lesson 2 stops (its users
    not yet due are never sent, its replies under way are aborted, saying why) before lesson 3 sets anything,
    so lesson 3 runs step for step as it does alone, and no step of it carries a request of lesson 2."""
    from app.ui.lessons import STOPPED
    two, three = LESSONS[1], LESSONS[2]
    # long replies and a late document: pressed at the first user, lesson 3 comes some hundred steps before
    # lesson 2's document is due; pressed once all are in, every reply of lesson 2 is still under way
    params = {**FAST, "long-prompt-interrupts": dict(reply_tokens=200, doc_tokens=2, doc_at=150)}
    service, ui = start_service(str(tiny_model), params)
    records: list[dict] = []
    arrivals = get_scenario(two.scenario, **params[two.scenario]).arrivals

    notes: list[str] = []                 # the notes lesson 2's tab showed, last last

    async def main():
        async with recording(service, records):
            tab = Tab("lecturer")
            first = asyncio.ensure_future(drain(ui.run_scenario(two.scenario, two.policies, "", tab, two), notes))
            panels = ui.sessions.get(tab.session_hash).panels
            want = 1 if when == "its first user is in" else len(arrivals)
            while sum(1 for p in panels for turn in p.turns if turn.rid) < want:
                await asyncio.sleep(0.005)
            other = tab if where == "the same tab" else Tab("projector")
            await asyncio.wait_for(drain(ui.run_scenario(three.scenario, three.policies, "", other, three)), 120)
            await asyncio.wait_for(first, 30)             # it ended, without an error
            await asyncio.sleep(0.3)

    try:
        asyncio.run(main())
    finally:
        service.stop()
    # lesson 3's one pass opens with the last policy event; lesson 2 had stopped, its users all admitted, before it
    opened = max(i for i, r in enumerate(records) if r["type"] == "policy")
    arrived = lambda part: {r["req"]: r["label"] for r in part if r["type"] == "request" and r["event"] == "arrived"}
    earlier, mine = arrived(records[:opened]), arrived(records[opened:])
    ends = {r["req"]: r for r in records if r["type"] == "request" and r["event"] in ("finished", "aborted")}
    assert earlier and all(ends[rid]["event"] == "aborted" and ends[rid]["reason"] == STOPPED for rid in earlier), \
        {rid: ends.get(rid) for rid in earlier}
    if when == "its first user is in":
        assert arrivals[-1].label not in earlier.values(), "lesson 2's document was sent after lesson 3 was pressed"
    else:
        assert len(earlier) == len(arrivals)
    run = {"lesson": 3, "rids": set(mine), "records": records[opened:]}
    got, want = passes(run), passes(run_lessons([3], str(tiny_model), params)[0])
    assert [e["policy"] for e, _ in got] == ["chunked"]
    assert [shape(s) for s in got[0][1]] == [shape(s) for s in want[0][1]]
    assert not [s for s in run["records"] if s["type"] == "step" and any(i["req"] in earlier for i in s["items"])], \
        "a step of lesson 3 ran a request of lesson 2"
    # a tab whose lesson another tab stopped says so (its note of the settings in force is no longer true);
    # one pressed in the same tab is drawn by the new lesson
    stopped = t("en", "lesson_stopped")
    assert (notes[-1] == stopped) == (where == "another tab") and stopped not in notes[:-1], notes[-3:]
    # every viewer was told: lesson 2 started, then lesson 3 (the stopped one says nothing more), which ended
    told = [(r["event"], r["lesson"]) for r in records if r["type"] == "lesson"]
    assert told == [("started", 2), ("started", 3), ("ended", 3)], told


def test_a_tab_without_the_presenter_key_stops_no_lesson(tiny_model):
    """Where a presenter key is set, a student who presses lesson 2's button while the lecturer's lesson 2 runs
    plays its scenario under the settings in force (it may change none): the student's users are sent beside
    the lecturer's, and nothing of the lecturer's lesson is stopped."""
    two = LESSONS[1]
    params = {**FAST, "long-prompt-interrupts": dict(reply_tokens=40, doc_tokens=2, doc_at=20)}
    service, ui = start_service(str(tiny_model), params, presenter_key="lecturer-key")
    records: list[dict] = []

    async def main():
        async with recording(service, records):
            lecturer = asyncio.ensure_future(drain(ui.run_scenario(two.scenario, two.policies, "lecturer-key",
                                                                   Tab("lecturer"), two)))
            while not any(turn.rid for p in ui.sessions.get("lecturer").panels for turn in p.turns):
                await asyncio.sleep(0.005)
            await asyncio.wait_for(drain(ui.run_scenario(two.scenario, two.policies, "", Tab("student"), two)), 120)
            await asyncio.wait_for(lecturer, 120)
            await asyncio.sleep(0.3)

    try:
        asyncio.run(main())
    finally:
        service.stop()
    sent = {tab: {turn.rid for p in ui.sessions.get(tab).panels for turn in p.turns if turn.rid}
            for tab in ("lecturer", "student")}
    ends = {r["req"]: r for r in records if r["type"] == "request" and r["event"] in ("finished", "aborted")}
    n = len(get_scenario(two.scenario, **params[two.scenario]).arrivals)
    assert len(sent["lecturer"]) == len(sent["student"]) == n, sent
    assert all(ends[rid]["event"] == "finished" for rid in sent["lecturer"] | sent["student"]), \
        {rid: ends.get(rid) for rid in sent["lecturer"] | sent["student"]}


def test_a_lesson_pressed_while_the_pair_starts_does_not_wait_for_it(tiny_model):
    """Lesson 5's second pass waits for the two workers to load (a minute on a slow machine); lesson 6 pressed
    meanwhile stops it there and starts at once, not once the workers are up."""
    five = next(x for x in LESSONS if "disaggregated" in x.policies)
    six = next(x for x in LESSONS if x.scenario == "shared-system-prompt")
    service, ui = start_service(str(tiny_model))
    real_set, real_state, asked = service.set_policy, service.engine_state, []

    async def set_policy(**change):            # the pair is asked for, and never comes up
        if change["policy"] == "disaggregated":
            asked.append(change)
            return {}
        return await real_set(**change)

    async def engine_state():
        return {**await real_state(), "disaggregated": "starting"} if asked else await real_state()
    service.set_policy, service.engine_state = set_policy, engine_state

    async def main():
        tab = Tab("lecturer")
        notes = []

        async def lesson_five():
            async for out in ui.run_scenario(five.scenario, five.policies, "", tab, five):
                notes.append(out[-1])
        first = asyncio.ensure_future(lesson_five())
        while not asked:
            await asyncio.sleep(0.01)
        t0 = asyncio.get_running_loop().time()
        async for _ in ui.run_scenario(six.scenario, six.policies, "", tab, six):
            pass
        took = asyncio.get_running_loop().time() - t0
        await asyncio.wait_for(first, 10)
        return took, notes

    try:
        took, notes = asyncio.run(main())
    finally:
        service.stop()
    assert took < 60, f"lesson 6 waited {took:.0f} s for the pair lesson 5 had asked for"
    assert not any("did not start" in n for n in notes), notes
