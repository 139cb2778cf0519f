"""EngineSwitch: the single engine and the disaggregated pair behind one `Engine` (engine/protocol.py).

    engine = EngineSwitch(EngineConfig(policy="chunked"), call_soon=loop.post)   # loads the single engine
    engine.set_policy("disaggregated")    # the first time: starts the pair on a helper thread
    engine.pair_state                     # None, "starting", "ready" or "failed: <why>" (also in stats())
    engine.set_policy("chunked")          # back: the pair stops once it has been idle PAIR_IDLE_S seconds

Three settings (`static`, `continuous`, `chunked`) run on one LLMEngine. The fourth,
`disaggregated`, runs on a DisaggregatedEngine (engine/disagg/router.py: two worker
processes, each loading its own copy of the model). The pair starts on a helper
thread the first time the setting is chosen; until it is ready new requests keep
going to the single engine. Then new requests go to the engine of the setting in
force, and requests in flight finish on the engine they started on. Once another
setting is chosen, the pair stops when it has had nothing to do for PAIR_IDLE_S
seconds (its two workers hold two more copies of the model, gigabytes on a lecturer's
laptop); choosing `disaggregated` again starts a new one.

Both engines share one clock and one step counter, so their records form one
stream, each step number given once, by the engine that ran the step.
Single-threaded like the engines: one thread calls everything here; only the
pair's loading runs beside it, and hands its result back through call_soon.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from engine.config import EngineConfig
from engine.errors import SpeculationRefused
from engine.llm_engine import LLMEngine
from engine.protocol import RequestInfo, RequestOutput, StepOutputs

log = logging.getLogger("batchscope.engine")
_UNSET = object()
BUDGETS = ("max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk")
PAIR_IDLE_S = 180.0     # seconds a pair no setting asks for may sit idle before its workers stop


class EngineSwitch:
    def __init__(self, config: EngineConfig, call_soon: Callable[[Callable[[], None]], None] | None = None):
        """call_soon(fn): run fn on the engine thread between steps, from any thread (EngineLoop.post). The
        helper thread that loads the pair hands it over through it. Without one, the pair joins at the
        next call made here."""
        self.config = config
        self._later: deque[Callable[[], None]] = deque()
        self.call_soon = call_soon or self._later.append
        disaggregated = config.policy == "disaggregated"
        if disaggregated and config.speculative_config is not None:
            raise SpeculationRefused()
        self.single = LLMEngine(replace(config, policy="chunked") if disaggregated else config)
        self.engine = self.single               # the engine new requests go to
        self.pair = None                        # a DisaggregatedEngine, once started and ready
        self.pair_state: str | None = None      # None (never chosen), "starting", "ready" or "failed: <why>"
        self.want_pair = False                  # the latest choice is `disaggregated`
        self.owner: dict[str, object] = {}      # live request id -> the engine it runs on
        self.listeners: list[Callable[[dict], None]] = []   # subscribed to both engines, as each starts
        self.closed = False
        self._pair_used = 0.0                   # monotonic time the pair was last chosen or busy
        self._idle_timer: threading.Timer | None = None
        self.model_name, self.max_model_len = self.single.model_name, self.single.max_model_len
        self.eos_token_ids = self.single.eos_token_ids
        if disaggregated:                       # soon, so that a subscriber added now hears its policy event
            self.call_soon(lambda: self.set_policy("disaggregated"))

    @property
    def engines(self) -> list:
        return [e for e in (self.single, self.pair) if e is not None]

    @property
    def step_index(self) -> int:
        return self.single.step_index           # one counter for both

    # ---- requests ----
    def add_request(self, **request) -> str:
        """LLMEngine.add_request's arguments; the request runs on the engine of the setting in force."""
        self._run_later()
        rid = self.engine.add_request(**request)
        self.owner[rid] = self.engine
        return rid

    def _owner(self, request_id: str):
        return self.owner.get(request_id, self.engine)

    def get_request(self, request_id: str):
        """The request's Sequence on whichever engine runs it (engine-side readers and tests)."""
        return self._owner(request_id).get_request(request_id)

    def request_info(self, request_id: str) -> RequestInfo:
        return self._owner(request_id).request_info(request_id)

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        return self._owner(request_id).abort(request_id, reason)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    # ---- the step ----
    def step(self) -> StepOutputs | None:
        """One step of every engine with requests (the pair relays its workers' records, waiting 0.05 s at
        most). The record is the last engine's; the outputs are both engines'. None when both were idle."""
        self._run_later()
        if self.pair is not None and self.pair.has_unfinished():
            self._pair_used = time.monotonic()
        results = [e.step() if e is self.single else e.step(timeout=0.05)
                   for e in self.engines if e.has_unfinished()]
        results = [r for r in results if r is not None]
        if not results:
            return None
        return StepOutputs(results[-1].record, [o for r in results for o in self._ended(r.outputs)])

    def take_outputs(self) -> list[RequestOutput]:
        return [o for e in self.engines for o in self._ended(e.take_outputs())]

    def _ended(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            if o.finished:
                self.owner.pop(o.request_id, None)
        return outputs

    # ---- settings ----
    def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                   max_num_seqs: int | None = None, max_prefill_chunk=_UNSET, speculative_config=_UNSET,
                   enable_prefix_caching: bool | None = None, max_kv_blocks=_UNSET):
        """Apply the settings to the engine of that setting; new requests go there. `disaggregated` the
        first time starts the pair on a helper thread and returns at once (see pair_state). Speculative
        decoding and the cache settings are the single engine's: asked of the pair, speculation is refused
        (SpeculationRefused) and so are the cache settings (the pair's workers keep their own caches, whole
        and cached), and nothing changes."""
        self._run_later()
        budgets = dict(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        if max_prefill_chunk is not _UNSET:
            budgets["max_prefill_chunk"] = max_prefill_chunk
        if speculative_config is not _UNSET:
            budgets["speculative_config"] = speculative_config
        cache = {"enable_prefix_caching": enable_prefix_caching}
        if max_kv_blocks is not _UNSET:
            cache["max_kv_blocks"] = max_kv_blocks
        if policy == "disaggregated" or (policy is None and self.want_pair):
            if budgets.pop("speculative_config", self.single.speculative) is not None:
                raise SpeculationRefused()
            if enable_prefix_caching is False or cache.get("max_kv_blocks") is not None:
                raise ValueError("the disaggregated pair's workers keep their own KV caches: "
                                 "enable_prefix_caching=false and max_kv_blocks apply to the single engine only")
            self.single.speculative = None      # off here too: the pair's policy event says so for both
            self.want_pair, self._pair_used = True, time.monotonic()
            if self.pair is None:
                self.single.set_policy(None, **budgets, **cache)     # checks and keeps the budgets for the pair
                if self.pair_state is None or self.pair_state.startswith("failed"):
                    self.pair_state = "starting"
                    threading.Thread(target=self._start_pair, name="batchscope-disagg-start", daemon=True).start()
            else:
                self.single.set_policy(None, **cache)
                self.pair.set_policy(None, **budgets)
                self.engine = self.pair
        else:
            self.single.set_policy(policy, **budgets, **cache)
            if self.want_pair:
                self._pair_used = time.monotonic()
            self.want_pair, self.engine = False, self.single
            self._arm_idle_stop(PAIR_IDLE_S)

    def reset_prefix_cache(self):
        """The single engine's prefix cache (the pair's workers keep their own)."""
        self.single.reset_prefix_cache()

    def settings(self) -> dict:
        return self.engine.settings()

    @property
    def num_waiting(self) -> int:
        self._run_later()
        return self.engine.num_waiting

    def stats(self) -> dict:
        """The engine in force's, with `disaggregated`: the pair's state (pair_state)."""
        self._run_later()
        return {**self.engine.stats(), "disaggregated": self.pair_state, "memory": self.memory()}

    def memory(self) -> dict:
        """This process's resident bytes and its KV cache (the single engine's, which stays loaded beside the
        pair), and, once the pair runs, its workers' (DisaggregatedEngine.memory)."""
        out = self.single.memory()
        if self.pair is not None:
            out["workers"] = self.pair.memory()["workers"]
        return out

    @property
    def device(self) -> str:
        return self.single.device

    # ---- the pair's start ----
    def _start_pair(self):
        """Helper thread: two worker processes, each loading the model (seconds to a minute)."""
        from engine.disagg.router import DisaggregatedEngine
        try:
            pair = DisaggregatedEngine(replace(self.config, policy="disaggregated", speculative_config=None),
                                       t0=self.single.t0, steps=self.single.steps)
        except Exception as e:
            log.exception("the disaggregated workers did not start")
            state = f"failed: {type(e).__name__}: {e}"       # e is gone once this block ends
            self.call_soon(lambda: setattr(self, "pair_state", state))
            return
        if self.closed:
            pair.close()                        # closed while the workers were loading
        else:
            self.call_soon(lambda: self._pair_ready(pair))

    def _pair_ready(self, pair):
        """Engine thread: the loaded pair joins, with the settings chosen meanwhile."""
        for fn in self.listeners:
            pair.subscribe(fn)
        self.pair, self.pair_state, self._pair_used = pair, "ready", time.monotonic()
        if self.want_pair:
            s = self.single.settings()
            self.set_policy("disaggregated", **{k: s[k] for k in BUDGETS})
        else:                                   # another setting was chosen while it loaded
            self._arm_idle_stop(PAIR_IDLE_S)

    # ---- the pair's stop, once nothing asks for it ----
    def _arm_idle_stop(self, seconds: float):
        """In `seconds`, look again on the engine thread (call_soon wakes it, even when idle)."""
        if self.pair is None or self.closed or self._idle_timer is not None:
            return
        self._idle_timer = threading.Timer(seconds, lambda: self.call_soon(self._stop_idle_pair))
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _stop_idle_pair(self):
        """Engine thread: stop the pair if no setting asks for it and it has been idle PAIR_IDLE_S seconds;
        if it is still wanted, nothing; if it is busy or was used lately, look again later."""
        self._idle_timer = None
        if self.pair is None or self.want_pair or self.closed:
            return
        idle = time.monotonic() - self._pair_used
        if self.pair.has_unfinished() or idle < PAIR_IDLE_S:
            self._arm_idle_stop(max(PAIR_IDLE_S - idle, 1.0))
            return
        pair, self.pair, self.pair_state = self.pair, None, None
        log.info("the disaggregated pair was idle %.0f s with another setting in force: its workers stop", idle)
        pair.close()

    def _run_later(self):
        """Without a call_soon: what the helper thread handed over, run now, on the calling thread."""
        while self._later:
            self._later.popleft()()

    # ---- listeners: both engines' records, one stream, each a dict of its own ----
    def subscribe(self, fn):
        self.listeners.append(fn)
        for e in self.engines:
            e.subscribe(fn)

    def unsubscribe(self, fn):
        if fn in self.listeners:
            self.listeners.remove(fn)
        for e in self.engines:
            e.unsubscribe(fn)

    def close(self):
        """Stop the pair's workers, now or, if they are still loading, as soon as they are loaded."""
        self.closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.pair is not None:
            self.pair.close()
