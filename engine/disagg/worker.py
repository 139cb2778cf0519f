"""One worker of the disaggregated pair: an LLMEngine in a process of its own (engine/disagg/router.py routes).

  prefill worker  runs prompts (in chunks under its token budget) up to and including
                  the first token; then copies the request's KV, block by block, into a
                  staging area in shared memory and frees its own blocks.
  decode worker   adopts the request (prompt + first token; its KV copied from the
                  staging area into blocks of its own) and decodes it to the end.

Between its steps a worker runs the router's commands (engine/disagg/messages.py) and
sends back its records, request events and its requests' progress. It moves a
request in or out of its engine only through LLMEngine's public methods (`hold`,
`release`, `adopt`, `share_clock`).
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

from engine.config import EngineConfig
from engine.disagg.messages import (
    Abort,
    AbortDone,
    Add,
    Adopt,
    Ask,
    Budgets,
    Dropped,
    Exported,
    Imported,
    Out,
    Pause,
    Progress,
    Ready,
    Release,
    Reply,
    Stop,
)
from engine.llm_engine import LLMEngine
from engine.memory import freeze_survivors
from engine.outputs.records import kv_ops
from engine.scheduling.sequence import Sequence


@dataclass(frozen=True)
class Staging:
    """The shared-memory area KV blocks cross: (slots, layers, 2, block_size, kv_heads, head_dim)."""
    name: str
    shape: tuple[int, ...]
    dtype: str                       # torch dtype name

    def attach(self):
        import torch
        shm = SharedMemory(self.name)
        numel = 1
        for n in self.shape:
            numel *= n
        return shm, torch.frombuffer(shm.buf, dtype=getattr(torch, self.dtype), count=numel).view(self.shape)


class Worker:
    """One LLMEngine in a process of its own, running the router's commands between its steps."""

    def __init__(self, name: str, config: EngineConfig, staging: Staging, busy_slots: list[int],
                 wall0: float, commands, results):
        self.name, self.commands, self.results = name, commands, results
        self.engine = e = LLMEngine(config)
        import torch
        self.threads = torch.get_num_threads()
        e.share_clock(wall0)                                     # e.clock() now reads the router's clock
        self.shm, self.staging = staging.attach()
        self.free_slots = deque(s for s in range(staging.shape[0]) if s not in set(busy_slots))  # prefill
        self.outbox: list[Sequence] = []     # prefill: first token out, waiting for staging slots
        self.inbox: list[Adopt] = []         # decode: handed over, waiting for blocks
        self.sent: dict[str, tuple[int, int]] = {}   # request -> (tokens, characters) already sent
        self.out: list[dict] = []            # records and events since the last send
        self.handlers = {Add: self.add, Release: self.release, Adopt: self.adopt, Abort: self.abort,
                         Budgets: self.budgets, Ask: self.ask, Pause: self.pause}
        e.subscribe(self._keep)

    def _keep(self, obj: dict):
        if obj["type"] == "policy" or (obj["type"] == "request" and obj["event"] == "arrived"):
            return                           # the router publishes these, once for both workers
        if obj["type"] == "step":
            obj["worker"], obj["policy"], obj["threads"] = self.name, "disaggregated", self.threads
        self.out.append(obj)

    def run(self):
        e = self.engine
        self.results.put(Ready({"pid": os.getpid(), "threads": self.threads,
                                "num_blocks": e.block_manager.num_blocks, "max_model_len": e.max_model_len,
                                "device": e.device, "attention_backend": e.runner.backend.name,
                                "bytes_per_block": e.runner.bytes_per_block,
                                "kv_cache_bytes": e.runner.kv_cache_bytes}))
        while True:
            # idle: sleep until the router says something; busy: take what has come and step
            cmd = self._next(block=not e.scheduler.has_work())
            while cmd is not None:
                if isinstance(cmd, Stop):
                    self.results.cancel_join_thread()    # exit now, whether or not the router reads on
                    return
                self.handlers[type(cmd)](cmd)
                cmd = self._next(block=False)
            if e.scheduler.has_work():
                e.step()
            self._send()
            self._export() if self.name == "prefill" else self._import()

    def _next(self, block: bool):
        try:
            return self.commands.get(block)
        except queue.Empty:
            return None

    def _send(self):
        """The records and events of the last step and commands, with the requests' new tokens and text."""
        if not self.out:
            return
        touched = {i["req"] for o in self.out if o["type"] == "step" for i in o["items"]}
        touched |= {o["req"] for o in self.out if o["type"] == "request"}
        progress = {}
        for rid in touched & set(self.sent):
            seq = self.engine.get_request(rid)
            progress[rid] = self._progress(seq)
            if seq.is_finished:
                del self.sent[rid]
            elif self.name == "prefill" and seq.is_prefill_done and self.engine.hold(seq):
                self.outbox.append(seq)              # its first token is out: the decode worker goes on
        self.results.put(Out(self.out, progress))
        self.out = []

    def _progress(self, seq: Sequence) -> Progress:
        n, c = self.sent[seq.id]
        self.sent[seq.id] = (seq.num_output_tokens, len(seq.output_text))
        return Progress(seq.output_token_ids[n:], seq.token_times[n:], seq.output_text[c:], seq.logprobs[n:],
                        seq.first_token_time, seq.num_cached_tokens, seq.num_preemptions, seq.status,
                        seq.finish_reason, seq.finish_time, seq.error)

    # ---- prefill worker ----
    def add(self, m: Add):
        rid = self.engine.add_request(**m.request)
        self.engine.get_request(rid).arrival_time = m.arrival   # when the router took it
        self.sent[rid] = (0, 0)

    def release(self, m: Release):
        self.free_slots.extend(m.slots)

    def _export(self):
        """Hand over, oldest first, each prompt done whose blocks fit in the free staging slots."""
        e, bm = self.engine, self.engine.block_manager
        self.outbox = [s for s in self.outbox if not s.is_finished]      # aborted while waiting
        while self.outbox and len(bm.export_blocks(self.outbox[0])) <= len(self.free_slots):
            seq = self.outbox.pop(0)
            t0, blocks = e.clock(), bm.export_blocks(seq)
            slots = [self.free_slots.popleft() for _ in blocks]
            e.runner.copy_blocks_out(blocks, self.staging, slots)
            e.release(seq)                           # frees its blocks (they stay prefix-cached here)
            ops = kv_ops(bm)                         # those frees: sent with the hand-over, not with a later step
            del self.sent[seq.id]
            generator, seq.generator = seq.generator, None
            state = generator.get_state() if generator is not None else None
            self.results.put(Exported(seq, state, slots, t0, ops or ()))

    # ---- decode worker ----
    def adopt(self, m: Adopt):
        if m.generator_state is not None:
            import torch
            m.seq.generator = torch.Generator(self.engine.runner.device)
            m.seq.generator.set_state(m.generator_state)
        self.inbox.append(m)

    def _import(self):
        """Adopt, oldest first, each handed-over request its blocks fit in this cache."""
        e = self.engine
        while self.inbox:
            m = self.inbox[0]
            blocks = e.block_manager.import_blocks(m.seq, m.seq.num_computed_tokens)
            if blocks is None:
                return                               # the cache is full: wait for a reply to end
            e.runner.copy_blocks_in(self.staging, m.slots, blocks)
            self.inbox.pop(0)
            e.adopt(m.seq)
            self.sent[m.seq.id] = (m.seq.num_output_tokens, len(m.seq.output_text))
            self.results.put(Imported(m.seq.id, m.slots, m.t0, e.clock()))

    # ---- both ----
    def abort(self, m: Abort):
        self._abort(m)
        self.results.put(AbortDone(m.request_id))

    def _abort(self, m: Abort):
        for item in self.inbox:
            if item.seq.id == m.request_id:          # not adopted yet: only its staging slots to give back
                self.inbox.remove(item)
                self.results.put(Dropped(m.request_id, item.slots))
                return
        try:
            self.engine.abort(m.request_id, m.reason)    # frees its blocks, in the cache or the outbox
        except KeyError:
            pass                                     # already handed over, or never arrived
        self.sent.pop(m.request_id, None)

    def budgets(self, m: Budgets):
        self.engine.set_policy("chunked", **m.budgets)

    def ask(self, m: Ask):
        bm = self.engine.block_manager
        self.results.put(Reply(m.key, {"free": bm.num_free, "total": bm.num_blocks,
                                       "staging_free": len(self.free_slots),
                                       "live": self.engine.stats()["live_requests"],
                                       "inbox": len(self.inbox), "outbox": len(self.outbox)}))

    def pause(self, m: Pause):
        time.sleep(m.seconds)                        # tests: hold a request in the middle of a hand-over


def hold_lifeline(lifeline):
    """Die with the router, however it dies. lifeline is the read end of a pipe whose write end only the router
    holds: when the router's process ends (SIGKILL and the OOM killer included) the kernel closes it, the read
    end sees end-of-file and a thread here ends this process at once, wherever its main thread is. Without it a
    worker of a killed server would wait on its command queue for ever, holding its copy of the model.

    A second guard on Linux: PR_SET_PDEATHSIG, SIGKILL when the parent dies. The parent is the fork server
    (single-threaded, so the thread that forked us lives as long as it), or the router where workers are
    spawned, whose starting thread may end before the router does; hence the lifeline first."""
    def watch():
        try:
            lifeline.poll(None)                  # readable only at end-of-file: the router never writes
        except OSError:
            pass
        os._exit(1)
    threading.Thread(target=watch, name="batchscope-lifeline", daemon=True).start()
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def worker_main(environ: dict, lifeline, *args):
    """A worker process's body. It may be forked from a fork server started long before (engine/disagg/router.py):
    it takes the router's environment as it is now, as a freshly spawned process would."""
    hold_lifeline(lifeline)
    os.environ.clear()
    os.environ.update(environ)
    worker = Worker(*args)
    freeze_survivors()      # torch, the engine and the model live as long as the worker (engine/memory.py)
    worker.run()
    os._exit(0)      # nothing left to flush; skips seconds of interpreter teardown of torch and the model
