"""Replay a scenario against an engine, in-process, and keep everything it published.

    from demos.runner import run_scenario, Feeder
    run = run_scenario(engine, get_scenario("long-prompt-interrupts"))
    run.stream            # every StepRecord and request event, in order (a trace)
    run.request_ids       # the engine's id for each arrival, in scenario order
    metrics.summarize(run.stream)

run_scenario owns the step loop. A server whose engine thread owns the loop
uses a Feeder instead and calls `feeder.poll(steps_done, seconds_elapsed)`
before each step; it adds the arrivals that have fallen due.

Arrival offsets follow the scenario's clock (see app/scenarios.py): "step"
arrivals join just before the run's step of that index, and an engine that
runs out of work skips ahead to the next arrival; "wall" arrivals join at the
first step boundary after their time, and an idle engine sleeps until then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from app.scenarios import Replay, Scenario
from engine import SamplingParams


class Feeder:
    """Adds a scenario's arrivals to an engine as they fall due (app/scenarios.py's Replay)."""

    def __init__(self, scenario: Scenario, engine):
        self.scenario, self.engine = scenario, engine
        self.replay = Replay(scenario)
        self.request_ids: list[str | None] = [None] * len(scenario.arrivals)

    @property
    def done(self) -> bool:
        return self.replay.done

    @property
    def next_at(self) -> float | None:
        return self.replay.next_at

    def poll(self, steps_done: int, elapsed: float) -> list[str]:
        """Add every arrival due by now (steps or seconds, per the scenario's clock); their request ids."""
        added = []
        for i, a in self.replay.due(steps_done, elapsed):
            self.request_ids[i] = self.engine.add_request(**a.request_kwargs(), params=a.params(), label=a.label)
            added.append(self.request_ids[i])
        return added


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
    """Replay the scenario until all its requests have finished; return the stream it produced."""
    run = Run(scenario, engine_meta(engine, scenario))

    def listen(obj: dict):
        run.stream.append(obj)
        if on_record:
            on_record(obj)

    feeder = Feeder(scenario, engine)
    engine.subscribe(listen)
    t0, steps_done = time.perf_counter(), 0
    try:
        while steps_done < max_steps:
            feeder.poll(steps_done, time.perf_counter() - t0)
            if engine.step() is not None:
                steps_done += 1
            elif feeder.done:
                if all(r is None or engine.get_request(r).is_finished for r in feeder.request_ids):
                    break
            elif scenario.clock == "step":                # idle: skip ahead to the next arrival
                steps_done = feeder.replay.skip_idle(steps_done)
            else:
                time.sleep(max(0.0, feeder.next_at - (time.perf_counter() - t0)))
        else:
            raise RuntimeError(f"scenario {scenario.name!r} did not finish in {max_steps} steps")
    finally:
        engine.unsubscribe(listen)
    run.request_ids = list(feeder.request_ids)
    run.wall_s = time.perf_counter() - t0
    return run


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


def longest_prompt(engine, scenario: Scenario) -> int:
    return max(len(engine.tokenize(**a.request_kwargs())) for a in scenario.arrivals)


def warm_up(engine, tokens: int | None = None):
    """Run one throwaway request (a prompt of `tokens`, default the token budget, then a few decodes).

    The first passes of a fresh process pay one-off costs (allocator growth,
    kernel selection) that would otherwise land on whichever request comes
    first; a prompt as long as the scenario's longest warms the same shapes.
    """
    n = min(max(tokens or 0, engine.scheduler.token_budget), engine.max_model_len - 8)
    ids = [(7919 * i + 13) % engine.vocab_size for i in range(n)]   # no real text: never a prefix-cache hit
    rid = engine.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=4, ignore_eos=True),
                             label="warm-up")
    while not engine.get_request(rid).is_finished:
        engine.step()
