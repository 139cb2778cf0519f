"""EngineService: the engine on one background thread, driven from asyncio.

The engine is single-threaded and not thread-safe, so only the engine thread
ever touches it. Everyone else posts commands (add, abort, set_policy, read
stats) that the thread runs between steps; results come back to the caller's
event loop through loop.call_soon_threadsafe. When there is no work the thread
sleeps on a threading.Event that every command sets: no busy spin.

After each step the thread pushes, to every live request, the text its reply
gained since the last push (Sequence.output_text only ever grows), one
call_soon_threadsafe per event loop per step.

In-process API (the UI uses it; the OpenAI routes are built on it):
    async for text in service.stream(messages, params, label): ...
    stream = await service.submit(messages=..., params=..., label=...)
    sub = service.broadcaster.subscribe(snapshot_steps)   # records: the first get() is a snapshot
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from app.arrival_log import ArrivalLog
from app.broadcast import Broadcaster, RecordRing
from app.config import ServerConfig, check_step_delay
from app.request_stream import Delta, QueueFull, RequestStream, ServiceUnavailable, collect_deltas, deliver
from app.rate_limit import RateLimiter
from engine import EngineConfig, LLMEngine, SamplingParams

log = logging.getLogger("batchscope.server")


class EngineService:
    def __init__(self, engine_config: EngineConfig | None = None, config: ServerConfig | None = None):
        self.engine_config = engine_config or EngineConfig()
        self.config = config or ServerConfig()
        self.engine: LLMEngine | None = None          # engine thread only, once loaded
        self.step_delay = self.config.step_delay
        self.ring = RecordRing(self.config.history)
        self.broadcaster = Broadcaster(self.ring, self.config.ws_buffer, self.config.max_ws_subscribers)
        self.broadcaster.describe = self.describe
        self.limiter = RateLimiter(self.config.rate_limit_per_minute, self.config.rate_limit_burst)
        self.arrival_log = ArrivalLog()               # private: token ids for the what-if replay (app/whatif.py)
        self.whatif = None                            # the WhatIfJob in progress, stepped between live steps
        # ---- filled in by the engine thread when the model is loaded; read-only afterwards ----
        self.model_name = self.device = self.dtype = None
        self.max_model_len = 0
        self.settings: dict = {}                      # replaced whole whenever the policy changes
        # ---- engine-thread state ----
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}   # live requests that somebody is reading
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._stopping = False
        self.accepting = False
        # ---- health ----
        self.crashes = 0
        self.last_error: str | None = None
        self._last_crash = float("-inf")

    # ================= lifecycle (any thread) =================
    def start(self, timeout: float = 600.0):
        """Load the model on the engine thread and start its loop. Blocks until the model is ready."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="batchscope-engine", daemon=True)
        self._thread.start()
        if not self._loaded.wait(timeout):
            raise TimeoutError(f"the model did not load within {timeout:.0f} s")
        if self._load_error is not None:
            raise self._load_error
        self.accepting = True

    def begin_shutdown(self, reason: str = "server shutting down"):
        """Refuse new requests and abort the ones in flight. Safe from a signal handler."""
        self.accepting = False
        self._post(lambda: self._abort_all(reason))

    def stop(self, timeout: float = 10.0):
        self.begin_shutdown()
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        loop = self.broadcaster._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self.broadcaster.close_all)
        except RuntimeError:                # that loop has already closed
            pass

    @property
    def loaded(self) -> bool:
        return self._loaded.is_set() and self._load_error is None

    def health(self) -> tuple[bool, str]:
        if not self.loaded:
            return False, "loading" if self._load_error is None else "failed to load"
        if self._stopping or not self.accepting:
            return False, "shutting down"
        if self._thread is None or not self._thread.is_alive():
            return False, "engine thread is not running"
        if time.monotonic() - self._last_crash < self.config.health_recovery_s:
            return False, f"engine loop restarted after an error: {self.last_error}"
        return True, "ok"

    def describe(self) -> dict:
        """The engine as a viewer needs to know it: what runs where, and the settings in force."""
        return {"model": self.model_name, "device": self.device, "dtype": self.dtype,
                "max_model_len": self.max_model_len, "settings": {**self.settings, "step_delay": self.step_delay}}

    # ================= in-process API (event loop) =================
    async def submit(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                     label: str | None = None, client: str | None = None) -> RequestStream:
        """Queue a request; raises ValueError (bad prompt), QueueFull (queue full or client over its
        rate limit) or ServiceUnavailable. client: the sender's address, for the rate limit."""
        if not self.accepting:
            raise ServiceUnavailable("the server is shutting down" if self.loaded else "the model is loading")
        wait = self.limiter.retry_after(client)
        if wait:
            raise QueueFull(f"too many requests from this client ({self.config.rate_limit_per_minute} a minute); "
                            f"try again in {wait} s", wait)
        stream = RequestStream(self, asyncio.get_running_loop())

        def add():
            if not self.accepting:
                raise ServiceUnavailable("the server is shutting down")
            if self._num_waiting() >= self.config.max_waiting:
                raise QueueFull(f"{self.config.max_waiting} requests are already waiting; try again shortly",
                                self.config.retry_after_s)
            rid = self.engine.add_request(prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                                          params=ArrivalLog.seeded(params or SamplingParams()), label=label)
            seq = self.engine.get_request(rid)
            self.arrival_log.arrived(rid, seq.label, seq.arrival_time, self.engine.step_index,
                                     seq.prompt_token_ids, seq.params)
            stream.id, stream.label, stream.prompt_tokens = rid, seq.label, seq.prompt_len
            self._streams[rid] = stream
            return stream

        try:
            return await self.call(add)
        except asyncio.CancelledError:
            stream.close("client went away")   # commands run in order, so this abort follows the add
            raise

    async def stream(self, messages: list[dict], params: SamplingParams | None = None,
                     label: str | None = None) -> AsyncIterator[str]:
        """The reply's text, piece by piece. Leaving the loop early aborts the request."""
        stream = await self.submit(messages=messages, params=params, label=label)
        async with stream:
            async for delta in stream:
                if delta.error:
                    raise RuntimeError(delta.error)
                if delta.text:
                    yield delta.text

    def abort(self, request_id: str, reason: str = "aborted"):
        """Fire and forget, from any thread."""
        self._post(lambda: self._abort(request_id, reason))

    async def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                         max_num_seqs: int | None = None, step_delay: float | None = None,
                         **chunk) -> dict:
        """Change policy and budgets (in effect from the next step). chunk: max_prefill_chunk=int|None."""
        if step_delay is not None:
            check_step_delay(step_delay)
        # engine.set_policy reads 0 as "keep the current value"; here 0 is an error, as it should be
        for name, value in [("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
                            ("max_prefill_chunk", chunk.get("max_prefill_chunk"))]:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        def apply():
            old_delay = self.step_delay
            if step_delay is not None:
                self.step_delay = float(step_delay)     # first, so the policy event carries it
            try:
                self.engine.set_policy(policy, max_num_batched_tokens, max_num_seqs, **chunk)
            except Exception:
                self.step_delay = old_delay             # a rejected change changes nothing
                raise
            return {**self.engine.settings(), "step_delay": self.step_delay}
        return await self.call(apply)

    async def engine_state(self) -> dict:
        def read():
            return {**self.engine.stats(), "step_delay": self.step_delay}
        return await self.call(read, timeout=10.0)

    async def call(self, fn: Callable, timeout: float | None = None):
        """Run fn on the engine thread between steps and return its result here."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result, error):
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def run():
            try:
                result, error = fn(), None
            except Exception as e:
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:            # the caller's loop is gone
                pass
        self._post(run)
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailable(f"the engine did not answer within {timeout:.0f} s") from None

    # ================= engine thread =================
    def _post(self, command: Callable[[], None]):
        self._commands.append(command)      # deque.append is atomic: no lock needed
        self._wake.set()

    def _main(self):
        try:
            self._load()
        except BaseException as e:
            log.exception("could not load the model")
            self._load_error = e
            self._loaded.set()
            return
        self._loaded.set()
        failures = 0
        while not self._stopping:
            try:
                self._loop_once()
                failures = 0
            except Exception as e:          # log, fail what was in flight, and carry on with the same engine
                failures += 1
                self._recover(e)
                self._sleep(min(0.05 * 2 ** failures, 2.0))   # back off if it keeps failing
        self._drain()                       # answer whatever was asked before the end
        self._abort_all("server shutting down")

    def _load(self):
        engine = LLMEngine(self.engine_config)
        self.engine = engine
        name = self.config.served_model_name or engine.model_name
        self.model_name = Path(name).name if Path(name).is_dir() else name   # never show a machine path
        self.device, self.dtype, self.max_model_len = engine.device, engine.config.dtype, engine.max_model_len
        self.settings = engine.settings()
        engine.subscribe(self._on_record)

    def _loop_once(self):
        self._wake.clear()                  # before draining: a command posted after this still wakes us
        if self._drain():
            self._push_deltas()
        if self._stopping:
            return
        if not self.engine.has_unfinished():
            if not self._whatif_slice():
                self._wake.wait()           # idle: sleep until a command arrives
            elif self.whatif is not None and self.whatif.loading:
                self._wake.wait(0.02)       # its engine loads on a helper thread: do not spin meanwhile
            return
        record = self.engine.step()
        self._push_deltas()
        self._whatif_slice()                # one replay step per live step (app/whatif.py)
        if record is not None and not record["items"]:
            self._sleep(0.01)               # nothing could be scheduled this time: do not spin
        if self.step_delay > 0:
            self._sleep(self.step_delay)

    def _whatif_slice(self) -> bool:
        """One step of a what-if replay, if one is running. False when there was nothing to do."""
        job = self.whatif
        if job is None or not job.slice():
            self.whatif = None
            return False
        return True

    def _sleep(self, seconds: float):
        """Pause between steps, still running commands (aborts, policy changes) as they come."""
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(left)
            self._wake.clear()
            if self._drain():
                self._push_deltas()

    def _drain(self) -> bool:
        ran = False
        while self._commands:
            self._commands.popleft()()      # each command reports its own errors to its caller
            ran = True
        return ran

    def _on_record(self, obj: dict):
        """Engine listener, on the engine thread: O(items)."""
        self.arrival_log.observe(obj)
        if obj.get("type") == "policy":
            self.settings = {k: obj[k] for k in self.settings}
            obj["step_delay"] = self.step_delay     # the slow-motion setting travels with the others
        self.broadcaster.publish(obj)

    def _push_deltas(self):
        """After a step or commands: new text to its readers, new records to the viewers."""
        deliver(collect_deltas(self.engine, self._streams))
        self.broadcaster.flush()

    def _abort(self, rid: str, reason: str):
        try:
            self.engine.abort(rid, reason)
        except KeyError:
            pass                            # long finished and forgotten

    def _abort_all(self, reason: str):
        if self.engine is None:
            return
        for rid in list(self._streams):
            self._abort(rid, reason)
        self._push_deltas()

    def _recover(self, error: Exception):
        log.exception("the engine loop failed; failing the requests in flight and restarting it")
        self.crashes += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self._last_crash = time.monotonic()
        message = f"engine error: {self.last_error}"
        by_loop: dict = {}
        for rid, stream in list(self._streams.items()):
            tokens = stream.completion_tokens
            try:
                self.engine.abort(rid, message)
                tokens = self.engine.get_request(rid).num_output_tokens
            except Exception:
                log.exception("could not abort %s after the engine error", rid)
            del self._streams[rid]
            by_loop.setdefault(stream.loop, []).append((stream, Delta("", tokens, "error", message)))
        deliver(by_loop)
        self.broadcaster.flush()

    def _num_waiting(self) -> int:
        return self.engine.stats()["waiting"]
