"""Replay a scenario against an engine, in-process, and keep everything it published.

    from demos.compare.runner import run_scenario
    run = run_scenario(engine, get_scenario("long-prompt-interrupts"))
    run.stream            # every StepRecord and request event, in order (a trace)
    run.request_ids       # the engine's id for each arrival, in scenario order
    metrics.summarize(run.stream)

run_scenario owns the step loop. The server, whose engine thread owns its loop,
hands a lesson's arrivals out with app/replay/play.py's Replay instead (app/ui/lessons.py).

Arrival offsets follow the scenario's clock (see app/replay/scenarios.py): "step"
arrivals join just before the run's step of that index, and an engine that
runs out of work skips ahead to the next arrival; "wall" arrivals join at the
first step boundary after their time, and an idle engine sleeps until then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from app.replay.play import engine_meta, longest_prompt, play, warm_up  # noqa: F401  (re-exported)
from app.replay.scenarios import Scenario


@dataclass
class Run:
    scenario: Scenario
    meta: dict                          # who ran it: policy, budgets, model, dtype, device, date
    stream: list[dict] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def request_of(self, label: str) -> str:
        """The engine id of the (first) arrival with this label."""
        for a, rid in zip(self.scenario.arrivals, self.request_ids):
            if a.label == label:
                return rid
        raise KeyError(label)


def run_scenario(engine, scenario: Scenario, on_record: Callable[[dict], None] | None = None,
                 max_steps: int = 1_000_000) -> Run:
    """Replay the scenario until all its requests have finished; return the stream it produced.
    The loop is app.replay.play.play, the same one the what-if replay steps through."""
    run = Run(scenario, engine_meta(engine, scenario))
    ids: list[str | None] = [None] * len(scenario.arrivals)

    def listen(obj: dict):
        run.stream.append(obj)
        if on_record:
            on_record(obj)

    def added(i: int, rid: str):
        ids[i] = rid

    engine.subscribe(listen)
    t0 = time.perf_counter()
    try:
        for _ in play(engine, scenario, on_add=added, max_steps=max_steps):
            pass
    finally:
        engine.unsubscribe(listen)
    run.request_ids = ids
    run.wall_s = time.perf_counter() - t0
    return run
