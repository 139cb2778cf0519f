"""EngineLoop: the engine on its own thread, between commands and steps.

The engine is single-threaded and not thread-safe, so only this thread ever
touches it. Everyone else posts commands (add, abort, set_policy, read stats)
that the thread runs between steps; results come back to the caller's event
loop through loop.call_soon_threadsafe. When there is no work the thread
sleeps on a threading.Event that every command sets: no busy spin.

The engine is an `Engine` (engine/protocol.py): by default an EngineSwitch
(engine/engines.py), the single engine and, once chosen, the disaggregated
pair. Each step returns every request's new output; the thread hands each
reply's to its RequestStream, one call_soon_threadsafe per event loop per
step, and wakes the viewers once. An exception in a step fails the requests
in flight and the loop carries on with the same engine.

Calls go one way: the service (app/serving/service.py) calls the loop and subscribes
to its records; the loop never calls the service. An admission crosses from the
event loop to this thread once (`admit`, checks and the private arrival log
included). The engine's records do not call back into the loop either: the engine
appends them to a list, and the loop hands them to its subscribers after each
step and each command, before any reply sees that step's tokens.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from app.config import ServerConfig
from app.replay.arrival_log import ArrivalLog
from app.serving.broadcast import Broadcaster
from app.serving.front import Delta, QueueFull, RequestStream, ServiceUnavailable, ShuttingDown, deliver
from engine import EngineConfig
from engine.memory import release_free_heap
from engine.outputs.records import Listeners
from engine.protocol import Engine, RequestInfo, RequestOutput

log = logging.getLogger("batchscope.server")
HEAP_IDLE_S = 1.0       # idle this long after steps: the heap's free memory goes back to the system
HOLD_LIMIT_S = 5.0      # a step hold nobody moves for this long is dropped: a vanished runner cannot freeze the room


class EngineLoop:
    def __init__(self, engine_config: EngineConfig, broadcaster: Broadcaster, config: ServerConfig,
                 arrival_log: ArrivalLog, make_engine: Callable[[Callable], Engine] | None = None):
        """make_engine(call_soon): builds the engine on the engine thread (default: an EngineSwitch of
        engine_config; tests pass one on a tiny model). call_soon(fn) runs fn on the engine thread."""
        self.engine_config, self.broadcaster, self.arrival_log = engine_config, broadcaster, arrival_log
        self.config = config                    # read at each admission: max_waiting, retry_after_s
        self.make_engine = make_engine or self._switch
        self.step_delay = config.step_delay     # seconds of pause after each step; set on the engine thread
        self.admitting = True                   # False once the server is ending (abort_all)
        self.engine: Engine | None = None       # engine thread only, once loaded
        self.info: dict = {}                    # the engine as loaded (model, device, dtype, max_model_len,
                                                # settings): written once before start() returns
        self.memory: dict = {}                  # engine.memory() as the engine thread last read it (replaced
        self._memory_at = float("-inf")         # whole): after commands, and at most once a second while stepping
        self._stepped = False                   # steps ran since the heap was last handed back
        self.side_job = None                    # side work stepped between live steps (a what-if replay)
        self.streams: dict[str, RequestStream] = {}   # live requests that somebody is reading
        self._subscribers = Listeners()         # each gets every record; one that raises is removed
        self._records: deque[dict] = deque()    # what the engine published, not yet handed to the subscribers
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.stopping = False
        self.holds: dict[object, int] = {}      # engine thread only: holder -> the first step number it holds back
        self.held_since: float | None = None    # time.monotonic() when the loop began waiting at a hold
        self.held_rids: dict[object, set[str]] = {}   # holder -> the requests it added (its lesson's users)
        # ---- health ----
        self.crashes = 0
        self.last_error: str | None = None
        self.last_crash = float("-inf")         # time.monotonic() of the last loop failure

    def _switch(self, call_soon: Callable) -> Engine:
        from engine.engines import EngineSwitch
        return EngineSwitch(self.engine_config, call_soon=call_soon)

    def subscribe(self, fn: Callable[[dict], None]):
        """fn(record) on the engine thread for every record and event (before viewers see it); before start()."""
        self._subscribers.subscribe(fn)

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
        """The server is ending: admit nobody more, abort every request somebody reads; each stream's failure
        is ShuttingDown."""
        self.admitting = False
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
            self._publish()                     # what fn made the engine publish, before its caller goes on
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
    def admit(self, stream: RequestStream, held_by: object | None = None, **request) -> RequestInfo:
        """A request's whole admission, between steps: refused while the server ends (ShuttingDown) or the
        queue is full (QueueFull); else added (request: Engine.add_request's arguments, whose ValueError
        names a bad prompt), its reply delivered to `stream`, and its arrival logged privately for the
        what-if replay before the next step runs. held_by: the hold whose lesson it belongs to (hold())."""
        if not self.admitting:
            raise ShuttingDown("the server is shutting down")
        limit = self.config.max_waiting
        if self.engine.num_waiting >= limit:
            raise QueueFull(f"{limit} requests are already waiting; try again shortly", self.config.retry_after_s)
        rid = self.engine.add_request(**request)
        info = self.engine.request_info(rid)
        stream.id, stream.label, stream.prompt_tokens = rid, info.label, len(info.prompt_token_ids)
        self.streams[rid] = stream
        if held_by is not None and held_by in self.holds:
            self.held_rids.setdefault(held_by, set()).add(rid)
        self.arrival_log.arrived(rid, info.label, info.arrival_time, self.engine.step_index,
                                 info.prompt_token_ids, info.params)
        return info

    def hold(self, key: object, at: int | None) -> int:
        """Start no step numbered `at` or later until `key` moves its hold (None: let go). Commands still run
        meanwhile. A scripted lesson holds the engine at the step its next user is due (app/ui/lessons.py),
        so that user joins that step however late the records reach the lesson. A hold never stalls anyone
        else: while a request that no holder added is live (a student's, an API caller's), the engine steps
        on and the lesson's next user joins a step late. Returns the number the next step will get."""
        if at is None:
            self.holds.pop(key, None)
            self.held_rids.pop(key, None)
        else:
            self.holds[key] = at
        self.held_since = None
        return self.engine.step_index

    def _held(self) -> bool:
        """At a hold: wait for a command (one moves it) and say so; a hold nobody moves is dropped."""
        if not self.holds or self.engine.step_index < min(self.holds.values()):
            return False
        ours = set().union(*self.held_rids.values())
        if any(rid not in ours for rid in self.streams):
            return False                        # someone else's reply is under way: the room goes on
        now = time.monotonic()
        self.held_since = self.held_since or now
        if now - self.held_since > HOLD_LIMIT_S:
            log.warning("a step hold was not moved for %.0f s: letting the engine run", HOLD_LIMIT_S)
            self.holds.clear()
            self.held_rids.clear()
            return False
        self._wake.wait(HOLD_LIMIT_S - (now - self.held_since) + 0.01)
        return True

    def _publish(self):
        """Hand every record the engine published since the last call to the subscribers, in order."""
        while self._records:
            self._subscribers.emit(self._records.popleft())

    def _side_work(self) -> float | None:
        """One step of the side job, if there is one. None when there is none, else seconds to wait
        before the next call (its engine loads on a helper thread: do not spin meanwhile)."""
        job = self.side_job
        if job is None or not job.slice():
            self.side_job = None
            return None
        return 0.02 if job.loading else 0.0

    def _main(self):
        try:
            self.engine = self.make_engine(self.post)
            self.engine.subscribe(self._records.append)
            self._drain()                       # what the engine asked to run first (a disaggregated start)
            self._publish()
            e = self.engine
            stats = e.stats()
            self.info = {"model_name": e.model_name, "device": e.device, "dtype": stats["dtype"],
                         "max_model_len": e.max_model_len, "eos_token_ids": list(e.eos_token_ids),
                         "settings": e.settings(), "kv": stats["kv"],
                         "cuda_graphs": stats.get("cuda_graphs")}
            self._note_memory(force=True)
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
        self.engine.close()

    def _loop_once(self):
        self._wake.clear()                      # before draining: a command posted after this still wakes us
        if self._drain():
            self._deliver(self.engine.take_outputs())
            self._note_memory(force=True)       # a command may have started or replaced the pair's workers
        if self.stopping:
            return
        self._note_memory()
        if not self.engine.has_unfinished():
            pause = self._side_work()
            if pause is None:                   # idle: sleep until a command arrives
                # A lull after steps hands back what the largest of them left free in the heap (a lesson's
                # whole long prompt: engine/memory.py); a burst of requests one after another never waits
                # HEAP_IDLE_S, so its steps keep their memory warm.
                if not self._wake.wait(HEAP_IDLE_S if self._stepped else None):
                    release_free_heap()
                    self._stepped = False
                    self._note_memory(force=True)
            elif pause > 0:
                self._wake.wait(pause)
            return
        if self._held():
            return
        out = self.engine.step()
        self._stepped = True
        self._deliver(out.outputs if out else [])
        self._side_work()                       # side work takes one step per live step
        if out is not None and out.record is not None and not out.record["items"]:
            self._sleep(0.01)                   # nothing could be scheduled this time: do not spin
        if self.step_delay > 0:
            self._sleep(self.step_delay)

    def _note_memory(self, force: bool = False):
        """Read engine.memory() for /healthz and /metrics, which must not wait for the engine thread."""
        now = time.monotonic()
        if force or now - self._memory_at >= 1.0:
            self.memory, self._memory_at = self.engine.memory(), now

    def _sleep(self, seconds: float):
        """Pause between steps, still running commands (aborts, policy changes) as they come."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(left)
            self._wake.clear()
            if self._drain():
                self._deliver(self.engine.take_outputs())

    def _drain(self) -> bool:
        ran = False
        while self._commands:
            self._commands.popleft()()          # each command reports its own errors to its caller
            ran = True
        return ran

    def _deliver(self, outputs: list[RequestOutput]):
        """After a step or commands: new records to the subscribers, each reply's new output to its reader,
        then the viewers woken."""
        self._publish()
        by_loop: dict = {}
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue                        # nobody reads it (or its reader already had its end)
            if out.finished:
                del self.streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        deliver(by_loop)
        self.broadcaster.flush()

    def _abort(self, rid: str, reason: str):
        try:
            self.engine.abort(rid, reason)
        except KeyError:
            pass                                # long finished and forgotten

    def _abort_all(self, reason: str):
        if self.engine is None:
            return
        for rid, stream in list(self.streams.items()):
            stream.failure = ShuttingDown(reason)
            self._abort(rid, reason)
        self._deliver(self.engine.take_outputs())

    def _recover(self, error: Exception):
        log.exception("the engine loop failed; failing the requests in flight and restarting it")
        self.crashes += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self.last_crash = time.monotonic()
        message = f"engine error: {self.last_error}"
        self._publish()                         # what the failed step published before it raised
        for rid in list(self.streams):
            try:
                self.engine.abort(rid, message)
            except Exception:
                log.exception("could not abort %s after the engine error", rid)
        try:
            ended = {o.request_id: o.num_output_tokens for o in self.engine.take_outputs()}
        except Exception:
            log.exception("could not read the aborted requests after the engine error")
            ended = {}
        by_loop: dict = {}
        for rid, stream in list(self.streams.items()):
            tokens = ended.get(rid, stream.completion_tokens)
            del self.streams[rid]
            by_loop.setdefault(stream.loop, []).append((stream, Delta(rid, "", [], tokens, "error", message)))
        deliver(by_loop)
        self.broadcaster.flush()
