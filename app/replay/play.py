"""A scenario's replay: its arrivals handed out as they fall due (Replay), and the loop that feeds them
to an engine and steps it until every request has ended (play), which demos/compare/runner.py and the
what-if replay (app/replay/whatif.py) share; with the warm-up request and a trace's header."""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from app.replay.scenarios import Arrival, Scenario
from engine.sampling_params import SamplingParams


class Replay:
    """A scenario's arrivals, handed out as they fall due on its clock.

    `due(steps_done, elapsed)` returns every arrival whose `at` has been reached
    (steps done for the "step" clock, seconds elapsed for "wall"). A replayer
    whose engine runs out of work on the step clock calls `skip_idle(steps_done)`:
    the next arrival then comes at once, as the scenario promises.
    """

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.pending: deque[tuple[int, Arrival]] = deque(enumerate(scenario.arrivals))

    @property
    def done(self) -> bool:
        return not self.pending

    @property
    def next_at(self) -> float | None:
        return self.pending[0][1].at if self.pending else None

    def now(self, steps_done: int, elapsed: float) -> float:
        return steps_done if self.scenario.clock == "step" else elapsed

    def due(self, steps_done: int, elapsed: float) -> list[tuple[int, Arrival]]:
        """(index in scenario.arrivals, arrival) for each arrival due by now, in order."""
        now, out = self.now(steps_done, elapsed), []
        while self.pending and self.pending[0][1].at <= now:
            out.append(self.pending.popleft())
        return out

    def skip_idle(self, steps_done: int) -> int:
        """The step count to use when the engine is idle: the next step arrival's, if later."""
        return max(steps_done, math.ceil(self.next_at)) if self.pending else steps_done


def play(engine, scenario: Scenario, on_add: Callable[[int, str], None] | None = None,
         max_steps: int = 1_000_000) -> Iterator[int]:
    """Feed the scenario's arrivals to `engine` and step it until every request has ended.

    A generator: it yields the number of steps done after each engine step, so
    a caller may interleave it with other work (app/replay/whatif.py runs it between
    the live engine's steps). "step" arrivals join just before the step of
    that index and an idle engine skips ahead to the next one; "wall" arrivals
    join at the first step boundary after their time, and an idle engine
    sleeps until then. on_add(index in scenario.arrivals, request id).
    """
    replay, ids = Replay(scenario), []
    t0, steps_done = time.perf_counter(), 0
    while steps_done < max_steps:
        for i, a in replay.due(steps_done, time.perf_counter() - t0):
            ids.append(rid := engine.add_request(**a.request_kwargs(), params=a.params(), label=a.label))
            if on_add:
                on_add(i, rid)
        out = engine.step()
        if out is not None and out.record is not None:       # the pair may return only new output
            steps_done += 1
            yield steps_done
        elif replay.done:
            if all(engine.get_request(r).is_finished for r in ids):
                return
        elif scenario.clock == "step":                # idle: skip ahead to the next arrival
            steps_done = replay.skip_idle(steps_done)
        else:
            time.sleep(max(0.0, replay.next_at - (time.perf_counter() - t0)))
    raise RuntimeError(f"scenario {scenario.name!r} did not finish in {max_steps} steps")


def longest_prompt(engine, scenario: Scenario) -> int:
    return max(len(engine.tokenize(**a.request_kwargs())) for a in scenario.arrivals)


def warm_up_steps(engine, tokens: int | None = None) -> Iterator[None]:
    """One throwaway request (a prompt of `tokens`, default the token budget, then a few decodes),
    yielding after each step.

    The first passes of a fresh engine pay one-off costs (allocator growth,
    kernel selection) that would otherwise land on whichever request comes
    first; a prompt as long as the scenario's longest warms the same shapes.
    """
    n = min(max(tokens or 0, engine.settings()["max_num_batched_tokens"]), engine.max_model_len - 8)
    ids = [(7919 * i + 13) % engine.vocab_size for i in range(n)]   # no real text: never a prefix-cache hit
    rid = engine.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=4, ignore_eos=True),
                             label="warm-up")
    while not engine.get_request(rid).is_finished:
        engine.step()
        yield


def warm_up(engine, tokens: int | None = None):
    for _ in warm_up_steps(engine, tokens):
        pass


def engine_meta(engine, scenario: Scenario | None = None) -> dict:
    """The header of a trace: what produced it."""
    s = engine.stats()
    meta = {"type": "trace", "version": 1, "model": s["model"], "device": s["device"], "dtype": s["dtype"],
            "attention_backend": s["attention_backend"], "policy": s["policy"],
            "max_num_batched_tokens": s["max_num_batched_tokens"], "max_num_seqs": s["max_num_seqs"],
            "max_prefill_chunk": s["max_prefill_chunk"], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if scenario is not None:
        meta.update(scenario=scenario.name, clock=scenario.clock,
                    arrivals=[{"at": a.at, "label": a.label, "max_tokens": a.max_tokens} for a in scenario.arrivals])
    return meta
