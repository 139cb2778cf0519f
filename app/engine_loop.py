"""EngineLoop: the engine on its own thread, between commands and steps.

The engine is single-threaded and not thread-safe, so only this thread ever
touches it. Everyone else posts commands (add, abort, set_policy, read stats)
that the thread runs between steps; results come back to the caller's event
loop through loop.call_soon_threadsafe. When there is no work the thread
sleeps on a threading.Event that every command sets: no busy spin.

After each step the thread pushes, to every live request, the text its reply
gained since the last push (Sequence.output_text only ever grows), one
call_soon_threadsafe per event loop per step, and wakes the viewers once.
An exception in a step fails the requests in flight and the loop carries on
with the same engine.

The fourth setting, `disaggregated`, runs on a second engine: a DisaggregatedEngine
(engine/disagg.py, two worker processes, each loading its own copy of the model).
It starts on a helper thread the first time the setting is chosen; until it is
ready new requests keep going to the single engine. Then new requests go to the
engine of the setting in force, and requests in flight finish on the engine they
started on. Both engines' step records reach the viewers numbered as one stream.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from app.broadcast import Broadcaster
from app.request_stream import Delta, RequestStream, ServiceUnavailable, collect_deltas, deliver
from engine import EngineConfig, LLMEngine

log = logging.getLogger("batchscope.server")


class EngineLoop:
    def __init__(self, engine_config: EngineConfig, broadcaster: Broadcaster, step_delay: float,
                 on_load: Callable[[LLMEngine], None], on_record: Callable[[dict], None],
                 between_steps: Callable[[], float | None] = lambda: None):
        """on_load(engine) and on_record(record) run on the engine thread: once when the model is
        loaded, and for every record the engine emits (before viewers see it). between_steps() runs
        side work (a what-if replay's step) after every live step and, while the engine is idle, over
        and over: it returns None when it had nothing to do, else seconds to wait before the next call."""
        self.engine_config, self.broadcaster = engine_config, broadcaster
        self.on_load, self.on_record, self.between_steps = on_load, on_record, between_steps
        self.step_delay = step_delay            # seconds of pause after each step; set on the engine thread
        self.engine: LLMEngine | None = None    # engine thread only, once loaded: the one new requests go to
        self.single: LLMEngine | None = None    # static, continuous, chunked
        self.pair = None                        # disaggregated: a DisaggregatedEngine, once started and ready
        self.pair_state: str | None = None      # None (never chosen), "starting", "ready" or "failed: <why>"
        self.want_pair = False                  # the presenter's latest choice is `disaggregated`
        self.owner: dict[str, object] = {}      # live request id -> the engine it runs on
        self.steps_published = 0                # one step numbering over both engines
        self.streams: dict[str, RequestStream] = {}   # live requests that somebody is reading
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.stopping = False
        # ---- health ----
        self.crashes = 0
        self.last_error: str | None = None
        self.last_crash = float("-inf")         # time.monotonic() of the last loop failure

    # ================= any thread =================
    def start(self, timeout: float):
        """Load the model on the engine thread and start its loop. Blocks until the model is ready."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="batchscope-engine", daemon=True)
        self._thread.start()
        if not self._loaded.wait(timeout):
            raise TimeoutError(f"the model did not load within {timeout:.0f} s")
        if self.load_error is not None:
            raise self.load_error

    def stop(self, timeout: float):
        self.stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def loaded(self) -> bool:
        return self._loaded.is_set() and self.load_error is None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self):
        """Make an idle engine thread look for work (side work included)."""
        self._wake.set()

    def post(self, command: Callable[[], None]):
        self._commands.append(command)          # deque.append is atomic: no lock needed
        self._wake.set()

    def abort(self, request_id: str, reason: str):
        self.post(lambda: self._abort(request_id, reason))

    def abort_stream(self, stream: RequestStream, reason: str):
        # commands run in order, so by the time this one runs the add has set stream.id
        self.post(lambda: stream.id is not None and self._abort(stream.id, reason))

    def abort_all(self, reason: str):
        self.post(lambda: self._abort_all(reason))

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
            except RuntimeError:                # the caller's loop is gone
                pass
        self.post(run)
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailable(f"the engine did not answer within {timeout:.0f} s") from None

    # ================= engine thread =================
    def add(self, stream: RequestStream, **request) -> RequestStream:
        """Add a request and deliver its reply to `stream` (request: LLMEngine.add_request's arguments)."""
        rid = self.engine.add_request(**request)
        seq = self.engine.get_request(rid)
        stream.id, stream.label, stream.prompt_tokens = rid, seq.label, seq.prompt_len
        self.streams[rid] = stream
        self.owner[rid] = self.engine
        return stream

    def get_request(self, rid: str):
        """The request on whichever engine runs it (engine thread)."""
        return self.owner.get(rid, self.engine).get_request(rid)

    @property
    def engines(self) -> list:
        return [e for e in (self.single, self.pair) if e is not None]

    def _publish(self, obj: dict):
        """Every record of either engine, to on_record; step numbers run on across engines (identical to
        the engine's own while only one has ever run)."""
        if obj["type"] == "step":
            obj["step"] = self.steps_published
            self.steps_published += 1
        elif obj["type"] == "policy" or "step" in obj:
            obj["step"] = self.steps_published         # the next step to come
        self.on_record(obj)

    # ---- the setting: which engine takes new requests ----
    def select(self, policy: str | None, **budgets) -> dict:
        """Engine thread: apply the presenter's settings to the engine of that setting; new requests go there.
        `disaggregated` the first time starts the pair on a helper thread and answers at once."""
        if policy == "disaggregated" or (policy is None and self.want_pair):
            self.want_pair = True
            if self.pair is None:
                self.single.set_policy(None, **budgets)     # checks and keeps the budgets for the pair
                if self.pair_state is None or self.pair_state.startswith("failed"):
                    self.pair_state = "starting"
                    threading.Thread(target=self._start_pair, name="batchscope-disagg-start", daemon=True).start()
            else:
                self.pair.set_policy(None, **budgets)
                self.engine = self.pair
        else:
            self.single.set_policy(policy, **budgets)
            self.want_pair, self.engine = False, self.single
        return {**self.engine.settings(), "disaggregated": self.pair_state}

    def _start_pair(self):
        """Helper thread: two worker processes, each loading the model (seconds to a minute)."""
        from engine.disagg import DisaggregatedEngine
        try:
            pair = DisaggregatedEngine(replace(self.engine_config, policy="disaggregated"), t0=self.single.t0)
        except Exception as e:
            log.exception("the disaggregated workers did not start")
            self.post(lambda: setattr(self, "pair_state", f"failed: {type(e).__name__}: {e}"))
            return
        if self.stopping:
            pair.close()                        # the server ended while the workers were loading
        else:
            self.post(lambda: self._pair_ready(pair))

    def _pair_ready(self, pair):
        pair.subscribe(self._publish)
        self.pair, self.pair_state = pair, "ready"
        if self.want_pair:
            s = self.single.settings()
            self.select("disaggregated", **{k: s[k] for k in ("max_num_batched_tokens", "max_num_seqs",
                                                              "max_prefill_chunk")})

    def _main(self):
        try:
            disaggregated = self.engine_config.policy == "disaggregated"
            config = replace(self.engine_config, policy="chunked") if disaggregated else self.engine_config
            self.engine = self.single = LLMEngine(config)
            self.engine.subscribe(self._publish)
            self.on_load(self.engine)
            if disaggregated:
                self.select("disaggregated")
        except BaseException as e:
            log.exception("could not load the model")
            self.load_error = e
            self._loaded.set()
            return
        self._loaded.set()
        failures = 0
        while not self.stopping:
            try:
                self._loop_once()
                failures = 0
            except Exception as e:              # log, fail what was in flight, and carry on with the same engine
                failures += 1
                self._recover(e)
                self._sleep(min(0.05 * 2 ** failures, 2.0))   # back off if it keeps failing
        self._drain()                           # answer whatever was asked before the end
        self._abort_all("server shutting down")
        if self.pair is not None:
            self.pair.close()

    def _loop_once(self):
        self._wake.clear()                      # before draining: a command posted after this still wakes us
        if self._drain():
            self._push_deltas()
        if self.stopping:
            return
        busy = [e for e in self.engines if e.has_unfinished()]
        if not busy:
            pause = self.between_steps()
            if pause is None:
                self._wake.wait()               # idle: sleep until a command arrives
            elif pause > 0:
                self._wake.wait(pause)
            return
        for engine in busy:                     # the pair's step relays its workers' records (0.05 s at most)
            record = engine.step() if engine is self.single else engine.step(timeout=0.05)
        self._push_deltas()
        self.between_steps()                    # side work takes one step per live step
        if record is not None and not record["items"]:
            self._sleep(0.01)                   # nothing could be scheduled this time: do not spin
        if self.step_delay > 0:
            self._sleep(self.step_delay)

    def _sleep(self, seconds: float):
        """Pause between steps, still running commands (aborts, policy changes) as they come."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(left)
            self._wake.clear()
            if self._drain():
                self._push_deltas()

    def _drain(self) -> bool:
        ran = False
        while self._commands:
            self._commands.popleft()()          # each command reports its own errors to its caller
            ran = True
        return ran

    def _push_deltas(self):
        """After a step or commands: new text to its readers, new records to the viewers."""
        for engine in self.engines:
            mine = {rid: s for rid, s in self.streams.items() if self.owner.get(rid) is engine}
            live = set(mine)
            deliver(collect_deltas(engine, mine))       # takes the ended requests out of `mine`
            for rid in live - mine.keys():
                del self.streams[rid], self.owner[rid]
        self.broadcaster.flush()

    def _abort(self, rid: str, reason: str):
        try:
            self.owner.get(rid, self.engine).abort(rid, reason)
        except KeyError:
            pass                                # long finished and forgotten

    def _abort_all(self, reason: str):
        if self.engine is None:
            return
        for rid in list(self.streams):
            self._abort(rid, reason)
        self._push_deltas()

    def _recover(self, error: Exception):
        log.exception("the engine loop failed; failing the requests in flight and restarting it")
        self.crashes += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self.last_crash = time.monotonic()
        message = f"engine error: {self.last_error}"
        by_loop: dict = {}
        for rid, stream in list(self.streams.items()):
            tokens = stream.completion_tokens
            try:
                self.owner.get(rid, self.engine).abort(rid, message)
                tokens = self.get_request(rid).num_output_tokens
            except Exception:
                log.exception("could not abort %s after the engine error", rid)
            del self.streams[rid]
            self.owner.pop(rid, None)
            by_loop.setdefault(stream.loop, []).append((stream, Delta("", tokens, "error", message)))
        deliver(by_loop)
        self.broadcaster.flush()
