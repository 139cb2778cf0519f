"""A whole lecture: every lesson in order, then lesson 3 again.

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

from app.replay.scenarios import LESSONS, SETTING_KEYS

# the lessons' own speed knobs (shorter replies, the document early); no pause between steps: the
# lesson runner holds the engine at the step each scripted user is due (tests/test_lesson_clock.py)
FAST = {"static-vs-continuous": dict(reply_tokens=(2, 7, 3, 5, 2, 8, 1, 4)),
        "long-prompt-interrupts": dict(reply_tokens=8, doc_tokens=2, doc_at=6),
        "budget-shapes": dict(reply_tokens=4),
        "split-prefill-decode": dict(reply_tokens=8, doc_tokens=2, doc_at=6),
        "speculative-room": dict(reply_tokens=48, room_at=6, room_tokens=24)}
STEP_DELAY = 0.0


class Tab:
    def __init__(self, name: str):
        self.session_hash = name


def start_service(model: str):
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui.page import UI
    from engine import EngineConfig
    service = EngineService(EngineConfig(model=model, dtype="float32", kv_cache_gb=0.25),
                            ServerConfig(step_delay=STEP_DELAY))
    service.start()
    return service, UI(service, scenario_params=FAST)


def run_lessons(order: list[int], model: str) -> list[dict]:
    """Play lessons (1-based) in order on one fresh server; per lesson, its passes' records."""
    service, ui = start_service(model)
    records: list[dict] = []

    async def main():
        sub = service.broadcaster.subscribe(0)

        async def collect():
            while (items := await sub.get()) is not None:
                records.extend(getattr(x, "obj", x) for x in items)
        collector = asyncio.ensure_future(collect())
        runs = []
        for n, k in enumerate(order):
            lesson, tab = LESSONS[k - 1], Tab(f"lesson-{n}")
            start = len(records)
            async for _ in ui.run_scenario(lesson.scenario, lesson.policies, "", tab):
                pass
            await asyncio.sleep(0.3)            # the last records reach the collector
            rids = {t.rid for p in ui.sessions.get(tab.session_hash).panels for t in p.turns if t.rid}
            runs.append({"lesson": k, "rids": rids, "records": records[start:]})
        sub.close()
        await collector
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
    order = [*range(1, len(LESSONS) + 1), 3]
    lecture = run_lessons(order, str(tiny_model))
    alone = {k: run_lessons([k], str(tiny_model))[0] for k in sorted(set(order))}
    for run in lecture:
        k, lesson = run["lesson"], LESSONS[run["lesson"] - 1]
        got, want = passes(run), passes(alone[k])
        assert [e["policy"] for e, _ in got] == list(lesson.policies), (k, [e["policy"] for e, _ in got])
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


def ui_setting(lesson, policy: str, index: int = 0) -> dict:
    from app.replay.scenarios import get_scenario
    return lesson.setting(get_scenario(lesson.scenario, **FAST[lesson.scenario]), policy, STEP_DELAY, index)


def test_the_speculative_lesson_after_another_runs_as_alone_and_leaves_speculation_off(tiny_model):
    """The last lesson (speculation off, then on) after lesson 1 takes the same steps as alone, drafts in
    its second pass only, and lesson 3 after it runs as alone: nothing of its speculation stays behind."""
    k = len(LESSONS)
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
