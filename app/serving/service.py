"""EngineService: admission, limits and settings in front of the engine's thread (app/serving/engine_loop.py).

Calls go one way: the service calls the loop and subscribes to its records
(`_on_record`, on the engine thread, after each step or command); the loop knows
nothing of the service. A request's admission is one call on the engine thread
(EngineLoop.admit).

It decides whether a request may enter (the server is up, the client is
within its rate limit, the queue has room), changes settings, reports
health, and hands records to the viewers (app/serving/broadcast.py) and to the
Prometheus metrics (app/serving/prometheus.py).

In-process API (the UI uses it; the OpenAI routes are built on it):
    async for text in service.stream(messages, params, label): ...
    stream = await service.submit(messages=..., params=..., label=...)
    sub = service.broadcaster.subscribe(snapshot_steps)   # records: the first get() is a snapshot
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from app.config import ServerConfig, check_step_delay
from app.replay.arrival_log import ArrivalLog
from app.serving.engine_loop import EngineLoop
from app.serving.front import QueueFull, RequestStream, ServiceFront, ServiceUnavailable, ShuttingDown
from app.serving.rate_limit import Caller
from engine import EngineConfig, SamplingParams
from engine.memory import resident_bytes
from engine.protocol import Engine

__all__ = ["EngineService", "QueueFull", "ServiceUnavailable", "ShuttingDown"]


class EngineService(ServiceFront):
    def __init__(self, engine_config: EngineConfig | None = None, config: ServerConfig | None = None,
                 make_engine: Callable[[Callable], Engine] | None = None):
        """make_engine(call_soon) -> Engine: what the engine thread runs (default: engine/engines.py's
        EngineSwitch of engine_config); tests pass one on a tiny model."""
        super().__init__(config, ArrivalLog())
        self.engine_config = engine_config or EngineConfig()
        self.loop = EngineLoop(self.engine_config, self.broadcaster, self.config, self.arrival_log, make_engine)
        self.loop.subscribe(self._on_record)

    # ================= lifecycle (any thread) =================
    def start(self, timeout: float = 600.0):
        """Load the model on the engine thread and start its loop. Blocks until the model is ready."""
        self.loop.start(timeout)
        info = self.loop.info
        name = self.config.served_model_name or info["model_name"]
        self.model_name = Path(name).name if Path(name).is_dir() else name   # never show a machine path
        self.device, self.dtype, self.max_model_len = info["device"], info["dtype"], info["max_model_len"]
        self.eos_token_ids = frozenset(info["eos_token_ids"])
        self.settings = info["settings"]
        self.cuda_graphs = info.get("cuda_graphs")
        self.metrics.attach(self.model_name, self.max_model_len, self.dtype, info["kv"])
        self.accepting = True

    def begin_shutdown(self, reason: str = "server shutting down"):
        """Refuse new requests and abort the ones in flight. Safe from a signal handler."""
        self.accepting = False
        self.loop.abort_all(reason)

    def stop(self, timeout: float = 10.0):
        self.begin_shutdown()
        self.loop.stop(timeout)
        self.broadcaster.close_all_threadsafe()

    @property
    def loaded(self) -> bool:
        return self.loop.loaded

    @property
    def engine(self) -> Engine | None:
        """The engine itself: touch it only on the engine thread (through call())."""
        return self.loop.engine

    @property
    def whatif(self):
        """The what-if replay in progress (app/replay/whatif.py), stepped by the engine thread between live steps."""
        return self.loop.side_job

    @whatif.setter
    def whatif(self, job):
        self.loop.side_job = job

    @property
    def step_delay(self) -> float:
        return self.loop.step_delay

    @property
    def crashes(self) -> int:
        return self.loop.crashes

    @property
    def last_error(self) -> str | None:
        return self.loop.last_error

    def memory(self) -> dict:
        """rss_bytes: this process's resident memory, read now; kv_cache_bytes: its KV cache's tensors; with
        the disaggregated pair, `workers`: each worker's resident memory, read now by the pid the engine
        thread last reported (EngineLoop.memory), and its KV cache. The numbers of /healthz and /metrics."""
        seen = self.loop.memory
        out = {"rss_bytes": resident_bytes(), "kv_cache_bytes": seen.get("kv_cache_bytes")}
        if "workers" in seen:
            out["workers"] = {name: {**w, "rss_bytes": resident_bytes(w["pid"])} for name, w in seen["workers"].items()}
        return out

    def health(self) -> tuple[bool, str]:
        if not self.loaded:
            return False, "loading" if self.loop.load_error is None else "failed to load"
        if self.loop.stopping or not self.accepting:
            return False, "shutting down"
        if not self.loop.alive:
            return False, "engine thread is not running"
        if time.monotonic() - self.loop.last_crash < self.config.health_recovery_s:
            return False, f"engine loop restarted after an error: {self.last_error}"
        return True, "ok"

    # ================= admission (event loop) =================
    async def submit(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                     label: str | None = None, client: Caller | None = None,
                     held_by: object | None = None) -> RequestStream:
        """Queue a request; raises ValueError (bad prompt), QueueFull (queue full or client over its
        rate limit, ServiceFront.check_rate) or ServiceUnavailable. held_by: the lesson's hold it belongs
        to (EngineLoop.hold: a hold stalls the engine only while every live request is its holders')."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down") if self.loaded else \
                ServiceUnavailable("the model is loading")
        self.check_rate(client)
        stream = RequestStream(asyncio.get_running_loop(), self.loop.abort_stream)
        # one crossing to the engine thread: the queue's check, the add and the arrival log (EngineLoop.admit)
        admit = partial(self.loop.admit, stream, held_by=held_by, prompt=prompt, messages=messages,
                        prompt_token_ids=prompt_token_ids, label=label,
                        params=ArrivalLog.seeded(params or SamplingParams()))
        try:
            await self.loop.call(admit)
            return stream
        except asyncio.CancelledError:
            stream.close("client went away")   # commands run in order, so this abort follows the add
            raise

    def abort(self, request_id: str, reason: str = "aborted"):
        """Fire and forget, from any thread."""
        self.loop.abort(request_id, reason)

    # ================= settings (event loop) =================
    async def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                         max_num_seqs: int | None = None, step_delay: float | None = None,
                         **nullable) -> dict:
        """Change policy and budgets (in effect from the next step); None keeps a value. The engine checks
        its own settings. nullable: max_prefill_chunk=int|None (None removes the cap) and
        speculative_config=dict|None (vLLM's form; None turns speculation off)."""
        if step_delay is not None:
            check_step_delay(step_delay)

        def apply():
            old_delay = self.loop.step_delay
            if step_delay is not None:
                self.loop.step_delay = float(step_delay)    # first, so the policy event carries it
            try:   # `disaggregated` moves new requests to the two-worker engine (engine/engines.py)
                self.engine.set_policy(policy, max_num_batched_tokens=max_num_batched_tokens,
                                       max_num_seqs=max_num_seqs, **nullable)
            except Exception:
                self.loop.step_delay = old_delay            # a rejected change changes nothing
                raise
            return {**self.engine.settings(), "disaggregated": self.engine.stats().get("disaggregated"),
                    "step_delay": self.loop.step_delay}
        return await self.loop.call(apply)

    async def reset_prefix_cache(self):
        """Forget every cached prefix (vLLM's reset_prefix_cache), between steps: a lesson starts clean."""
        await self.loop.call(self.engine.reset_prefix_cache, timeout=10.0)

    async def engine_state(self) -> dict:
        def read():
            return {"disaggregated": None, **self.engine.stats(), "step_delay": self.loop.step_delay}
        return await self.loop.call(read, timeout=10.0)

    async def hold(self, key: object, at: int | None) -> int:
        """Hold the engine before step number `at` until `key` moves the hold (None: let go); returns the
        number the next step will get (EngineLoop.hold). Used by the scripted lessons' step clock."""
        return await self.loop.call(partial(self.loop.hold, key, at), timeout=10.0)

    def let_go(self, key: object):
        """Drop `key`'s hold, fire and forget, from any thread (a lesson ending, cancelled or not)."""
        self.loop.post(partial(self.loop.hold, key, None))

    async def call(self, fn: Callable, timeout: float | None = None):
        """Run fn on the engine thread between steps and return its result here."""
        return await self.loop.call(fn, timeout)

    # ================= engine thread =================
    def _on_record(self, obj: dict):
        """Engine listener, on the engine thread: O(items)."""
        self.arrival_log.observe(obj)
        if obj.get("type") == "policy":
            self.settings = {k: obj[k] for k in self.settings}
            obj["step_delay"] = self.loop.step_delay    # the slow-motion setting travels with the others
        self.metrics.observe(obj)
        self.broadcaster.publish(obj)
