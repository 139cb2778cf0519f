"""The record stream of one vLLM engine: newline-delimited JSON over TCP, never in vLLM's way.

vLLM's step loop only appends each record (a frozen Record of engine/outputs/records.py, or a dict) to a
bounded deque: no lock, no wake-up of another thread (waking one would make the step loop hand it
the GIL), no serialising. When the deque is full the record is dropped and counted, and the next
record that gets through is preceded by a `{"type": "gap", "dropped": N}` line, so a slow or stuck
reader costs vLLM nothing but those records. One sender thread wakes every POLL_S, serialises what
piled up and writes it to every connected reader; a reader that cannot keep up for
`SEND_TIMEOUT_S` is disconnected.

Each reader first gets a `hello` line (what the engine is, its settings in force and its
data-parallel lane), then every record from the moment it connected.

    nc 127.0.0.1 8765        # one JSON object per line
"""
from __future__ import annotations

import json
import logging
import select
import socket
import threading
from collections import deque

log = logging.getLogger("batchscope.vllm")
QUEUE_RECORDS = 4096        # records held while the sender is behind (a few seconds of steps)
SEND_TIMEOUT_S = 2.0
POLL_S = 0.02           # the sender's wake-up period: records reach readers within it


class Publisher:
    def __init__(self, host: str, port: int, hello: dict):
        """Listens at once (port 0: any free port, see .port); raises OSError naming the address."""
        self.hello = hello
        self.dropped = 0                    # records dropped, in all
        self._unsent_gap = 0                # dropped since the last record that got through
        self._queue: deque = deque()           # appended by vLLM's thread, popped by the sender (both atomic)
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind((host, port))
        except OSError as e:
            self._server.close()
            raise OSError(f"batchscope's vLLM recorder cannot listen on {host}:{port} ({e.strerror}); "
                          f"set BATCHSCOPE_RECORDS_PORT to a free port") from None
        self._server.listen(16)
        self.host, self.port = self._server.getsockname()[:2]
        self._readers: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchscope-records", daemon=True)
        self._thread.start()

    # ---- vLLM's step loop: never blocks ----
    def publish(self, obj):
        """obj: a Record (serialised on the sender thread: records are frozen) or a dict."""
        if len(self._queue) >= QUEUE_RECORDS:
            self.dropped += 1
            self._unsent_gap += 1
            return
        if self._unsent_gap:
            self._queue.append({"type": "gap", "dropped": self._unsent_gap, "reason": "the recorder's queue was full"})
            self._unsent_gap = 0
        self._queue.append(obj)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)

    @property
    def num_readers(self) -> int:
        return len(self._readers)

    # ---- the sender thread ----
    def _run(self):
        try:
            while not self._stop.wait(POLL_S):
                self._accept()
                batch = []
                while self._queue and len(batch) < 512:     # what piled up goes out in one write per reader
                    batch.append(self._queue.popleft())
                if batch and self._readers:
                    self._send("".join(json.dumps(_plain(x), separators=(",", ":")) + "\n" for x in batch).encode())
        finally:
            for s in self._readers:
                s.close()
            self._server.close()

    def _accept(self):
        while select.select([self._server], [], [], 0)[0]:
            conn, addr = self._server.accept()
            conn.settimeout(SEND_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn.sendall((json.dumps(self.hello) + "\n").encode())
            except OSError:
                conn.close()
                continue
            log.info("a record reader connected from %s:%s", *addr[:2])
            self._readers.append(conn)

    def _send(self, data: bytes):
        for conn in list(self._readers):
            try:
                conn.sendall(data)
            except OSError:                             # gone, or too slow for SEND_TIMEOUT_S
                self._readers.remove(conn)
                conn.close()


def _plain(obj) -> dict:
    return obj.to_dict() if hasattr(obj, "to_dict") else obj
