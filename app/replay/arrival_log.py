"""ArrivalLog: the live session's requests, privately, so the presenter can replay them (app/replay/whatif.py).

For each request: when it arrived (engine clock and the index of the next
step), its prompt token ids, its sampling parameters and its label; beside
them, a copy of the records the live engine published from the first logged
arrival on (what actually happened). Token ids are private: they never go on
/ws/steps, into /api/trace, or to anyone without the presenter key. The log
lives in memory only (a restart clears it) and is bounded: once it holds
`max_requests` requests or `max_steps` steps it stops recording (a replay
needs an unbroken stretch) and says so until it is cleared.

The engine thread calls `arrived` and `observe`; the server reads `window` and
`status` and calls `clear` from its event loop. One lock guards it all.
"""
from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, replace

from app.readers.metrics import produces_token
from engine import SamplingParams


@dataclass(frozen=True)
class Logged:
    req: str
    label: str
    t: float                           # engine clock at arrival
    step: int                          # the first step it could join (the engine's next step index)
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams             # seed always set when sampling, so a replay draws the same tokens


class ArrivalLog:
    def __init__(self, max_requests: int = 256, max_steps: int = 4096):
        if max_requests < 1 or max_steps < 1:
            raise ValueError("the arrival log needs max_requests >= 1 and max_steps >= 1")
        self.max_requests, self.max_steps = max_requests, max_steps
        self._lock = threading.Lock()
        self.clear()

    def clear(self):
        with self._lock:
            self._arrivals: list[Logged] = []
            self._records: list[dict] = []        # steps and events since the first logged arrival
            self._steps = 0
            self._outputs: dict[str, int] = {}    # req -> output tokens so far
            self._ended: set[str] = set()
            self.full = False

    @staticmethod
    def seeded(params: SamplingParams) -> SamplingParams:
        """A sampled request without a seed gets one here, so the log knows the seed it ran with."""
        if params.greedy or params.seed is not None:
            return params
        return replace(params, seed=secrets.randbits(62))

    # ---- engine thread ----
    def arrived(self, req: str, label: str, t: float, step: int, prompt_token_ids: list[int],
                params: SamplingParams):
        with self._lock:
            if self.full or len(self._arrivals) >= self.max_requests:
                self.full = True
                return
            self._arrivals.append(Logged(req, label, t, step, tuple(prompt_token_ids), params))
            self._outputs[req] = 0

    def observe(self, obj: dict):
        """Every record the live engine publishes (O(items))."""
        kind = obj.get("type")
        with self._lock:
            # a request's "arrived" event reaches us after `arrived` (EngineLoop.admit): events are kept from the start
            if self.full or kind not in ("step", "request") or (kind == "step" and not self._arrivals):
                return
            if kind == "step":
                if self._steps >= self.max_steps:
                    self.full = True
                    return
                self._steps += 1
                for item in obj["items"]:
                    if item["req"] in self._outputs and produces_token(item):
                        self._outputs[item["req"]] += 1
            elif obj["event"] in ("finished", "aborted") and obj["req"] in self._outputs:
                self._ended.add(obj["req"])
            self._records.append(obj)

    # ---- readers (event loop) ----
    def status(self) -> dict:
        with self._lock:
            return {"requests": len(self._arrivals), "ended": len(self._ended), "steps": self._steps,
                    "first_step": self._arrivals[0].step if self._arrivals else None, "full": self.full,
                    "max_requests": self.max_requests, "max_steps": self.max_steps}

    def window(self, since_step: int = 0) -> tuple[list[tuple[Logged, int]], list[dict], int]:
        """(arrivals from since_step on that have ended, each with the output tokens it got; the live
        records from the first of them on; how many later arrivals are still running and left out)."""
        with self._lock:
            mine = [a for a in self._arrivals if a.step >= since_step]
            done = [(a, self._outputs[a.req]) for a in mine if a.req in self._ended]
            if not done:
                return [], [], len(mine)
            first = done[0][0].step
            records = [r for r in self._records if r.get("step", first) >= first and
                       (r["type"] == "step" or r["t"] >= done[0][0].t)]
            return done, records, len(mine) - len(done)


def from_saved(doc: dict) -> list[tuple[Logged, int]]:
    """The arrivals of a saved log (GET /api/whatif/log), as ArrivalLog.window returns them."""
    if not isinstance(doc, dict) or doc.get("type") != "arrival_log":
        raise ValueError("this file is not an arrival log: save one with GET /api/whatif/log (presenter key); "
                         "a viewer's trace (/api/trace) has no prompts to replay")
    return [(Logged(a["req"], a["label"], a["t"], a["step"], tuple(a["prompt_token_ids"]),
                    SamplingParams(**a["params"])), a["output_tokens"]) for a in doc["arrivals"]]
