"""The record streams of an attached vLLM server: one TCP stream per engine (data-parallel lane).

Each engine's recording scheduler (integrations/vllm) listens on its own port, the first engine's
plus its lane number, and sends a `hello` line (with its `lane`), then one JSON record per line.
How many engines there are: the first hello's `lanes` where vLLM still knows it in the engine (a MoE
model); for a dense model vLLM runs its data-parallel engines as independent ones that each believe
they are alone, so the next ports are tried while a recorder of the same vLLM answers there with the
next lane. Here one thread per
lane reads them and hands each record to `on_record`, after two changes that make several engines
one stream for the page:
  - times: the recorder stamps wall-clock seconds; they become seconds since the app attached;
  - steps: every lane numbers its own steps from 0 (and again after a restart), so steps are
    renumbered here in arrival order, the lane's own number kept in `lane_step`.
A lane that drops is reconnected every RETRY_S; meanwhile health() says which and why.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("batchscope.attach")
RETRY_S = 2.0
PROBE_S = 1.0           # to find another engine's recorder at start, past the lanes the hello named
TIME_FIELDS = ("t_start", "t_end", "t")


class RecordsUnavailable(ConnectionError):
    pass


def read_hello(host: str, port: int, timeout: float) -> tuple[socket.socket, dict]:
    """Connect and read the first line; raises RecordsUnavailable with what to do."""
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise RecordsUnavailable(f"no vLLM recording scheduler publishes records at {where} ({e.strerror or e}). "
                                 f"Start vLLM with --scheduler-cls integrations.vllm.RecordingScheduler "
                                 f"(docs/vllm.md), or name its record port with --attach-records") from None
    try:
        line = sock.makefile("rb").readline(1 << 16)
        hello = json.loads(line)
    except (OSError, ValueError):
        sock.close()
        raise RecordsUnavailable(f"{where} answered, but not with batchscope's record stream "
                                 f"(no hello line): is another service on that port?") from None
    if not isinstance(hello, dict) or hello.get("type") != "hello" or "settings" not in hello:
        sock.close()
        raise RecordsUnavailable(f"{where} sent {str(hello)[:80]!r}, not a batchscope recorder's hello")
    sock.settimeout(None)
    return sock, hello


class Lanes:
    """The lanes of one vLLM server, read on their own threads. on_record runs on those threads."""

    def __init__(self, host: str, port: int, on_record: Callable[[dict], None], t0: float):
        self.host, self.port, self.on_record, self.t0 = host, port, on_record, t0
        self.hello: dict = {}
        self.errors: dict[int, str] = {}        # lane -> why it is not connected now
        self.lanes = 1
        self._next_step = 0
        self._lock = threading.Lock()           # the step counter is shared by the lanes
        self._stop = threading.Event()

    def start(self, timeout: float):
        """Connect to lane 0 (raising RecordsUnavailable), find how many lanes there are, read them all."""
        sock, self.hello = read_hello(self.host, self.port, timeout)
        named = int(self.hello.get("lanes") or 1)
        socks = [sock]
        while True:
            lane = len(socks)
            found = self._probe(lane)
            if found is None and lane >= named:
                break
            socks.append(found)             # None below `named`: that engine's lane reconnects until it answers
        self.lanes = len(socks)
        for lane, s in enumerate(socks):
            self._spawn(lane, s)

    def _probe(self, lane: int) -> socket.socket | None:
        """The recorder of engine `lane` of the same vLLM, if one answers now at port + lane."""
        try:
            sock, hello = read_hello(self.host, self.port + lane, PROBE_S)
        except RecordsUnavailable:
            return None
        if hello.get("lane") != lane or hello.get("engine") != self.hello.get("engine"):
            sock.close()
            return None
        return sock

    def stop(self):
        self._stop.set()

    def _spawn(self, lane: int, sock: socket.socket | None):
        threading.Thread(target=self._run, args=(lane, sock), name=f"batchscope-vllm-lane{lane}", daemon=True).start()

    def _run(self, lane: int, sock: socket.socket | None):
        while not self._stop.is_set():
            if sock is None:
                try:
                    sock, _ = read_hello(self.host, self.port + lane, 5.0)
                except RecordsUnavailable as e:
                    self.errors[lane] = f"vLLM engine {lane}: {e}"
                    self._stop.wait(RETRY_S)
                    continue
            self.errors.pop(lane, None)
            try:
                for line in sock.makefile("rb"):
                    self._take(lane, json.loads(line))
                    if self._stop.is_set():
                        break
                self.errors[lane] = f"the record stream of vLLM engine {lane} closed (vLLM stopped?)"
            except (OSError, ValueError) as e:
                self.errors[lane] = f"the record stream of vLLM engine {lane} failed: {e}"
            sock.close()
            sock = None
            log.warning("%s; reconnecting", self.errors.get(lane))

    def _take(self, lane: int, obj: dict):
        if obj.get("type") == "hello":
            return
        for k in TIME_FIELDS:
            if isinstance(obj.get(k), (int, float)):
                obj[k] -= self.t0
        with self._lock:
            if obj.get("type") == "step":
                obj["lane_step"], obj["step"] = obj["step"], self._next_step
                if self.lanes > 1:
                    obj["lane"] = lane
                self._next_step += 1
            elif "step" in obj:                 # a preemption or policy event: the step about to be recorded
                obj["step"] = self._next_step
            self.on_record(obj)

    @property
    def healthy(self) -> bool:
        return not self.errors
