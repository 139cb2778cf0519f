"""Fan-out of StepRecords and request events to many viewers.

The engine thread appends every record to one numbered ring (O(1), whatever
the number of viewers) and, once per step, wakes the event loop.
Each viewer keeps only a cursor into the ring: it reads what it has not seen
yet, serialised once and shared by all. A viewer that falls more than
`buffer` records behind skips ahead and gets an explicit gap marker, so a
stuck browser neither slows the engine nor grows memory.

The ring holds only the recent past, so the per-setting metrics of a viewer that
joins late would come out wrong. The hub therefore also feeds every record to one
app/readers/metrics.py StretchMeter (the one definition, kept for the whole run) and sends
its `stretches` with every snapshot, then in a "stretches" message about once a
second while steps run; the page shows those for any setting it did not watch whole.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Callable

from app.readers.metrics import StretchMeter

STRETCHES_EVERY = 1.0       # seconds between two "stretches" messages while steps run


class TooManySubscribers(Exception):
    pass


class Entry:
    """One record in the ring; its JSON text is made on first read, on the event loop, once."""
    __slots__ = ("obj", "_text")

    def __init__(self, obj: dict):
        self.obj = obj
        self._text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            # default=str: a field the engine adds later must not cut every viewer off
            self._text = json.dumps(self.obj, separators=(",", ":"), default=str)
        return self._text


class RecordRing:
    """The last `capacity` records, numbered from 0 and never renumbered. Thread-safe."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots: list[Entry | None] = [None] * capacity
        self.head = 0                       # number of the next record
        self._lock = threading.Lock()

    def append(self, obj: dict):
        with self._lock:
            self._slots[self.head % self.capacity] = Entry(obj)
            self.head += 1

    def read(self, start: int, stop: int) -> list[Entry]:
        """Records start..stop-1, less any the ring has already overwritten."""
        with self._lock:
            start = max(start, self.head - self.capacity, 0)
            return [self._slots[i % self.capacity] for i in range(start, min(stop, self.head))]

    def last_steps(self, n: int) -> tuple[int, list[dict]]:
        """(head, records) where records are the last n steps and the events among them, oldest first."""
        with self._lock:
            head, out, steps = self.head, [], 0
            for i in range(head - 1, max(head - self.capacity, 0) - 1, -1):
                obj = self._slots[i % self.capacity].obj
                if obj.get("type") == "step":
                    if steps == n:
                        break
                    steps += 1
                out.append(obj)
        out.reverse()
        return head, out


class Subscription:
    """One viewer's cursor. get() waits for new records; it is used from the event loop only.

    The first get() returns a snapshot (settings and the last N steps); records follow from exactly
    where it ends, so none is lost or sent twice.
    """

    def __init__(self, hub: Broadcaster, snapshot_steps: int):
        self.hub, self.buffer = hub, hub.buffer
        self.cursor = hub.ring.head
        self.snapshot_wanted = snapshot_steps   # steps of history to send before the next records
        self.dropped = 0
        self.closed = False
        self._event = asyncio.Event()
        self._direct: deque[dict] = deque(maxlen=16)   # replies to this viewer only (pong, errors)
        self.stretches_seen: Entry | None = None        # the last "stretches" message this viewer got

    def post(self, obj: dict):
        self._direct.append(obj)
        self._event.set()

    def request_snapshot(self, steps: int):
        # one pending request at most: a viewer asking again and again costs one snapshot per send
        self.snapshot_wanted = steps
        self._event.set()

    def wake(self):
        self._event.set()

    def _idle(self) -> bool:
        return not (self.closed or self._direct or self.snapshot_wanted or self.hub.ring.head > self.cursor)

    async def get(self) -> list[Entry | dict] | None:
        """What this viewer has not seen yet: replies, a snapshot if one is due, a gap marker if it
        fell behind, then records. None once the subscription is closed."""
        ring = self.hub.ring
        while self._idle():
            self._event.clear()
            if self._idle():                # nothing arrived between the check and clear()
                await self._event.wait()
        if self.closed:
            return None
        out: list[Entry | dict] = list(self._direct)
        self._direct.clear()
        if self.snapshot_wanted:
            self.cursor, records = ring.last_steps(self.snapshot_wanted)
            self.snapshot_wanted = 0
            stretches = self.hub.stretches()
            self.stretches_seen = stretches
            out.append({"type": "snapshot", **self.hub.describe(), "lesson": self.hub.lesson, "records": records,
                        "stretches": stretches.obj["stretches"]})
            return out
        stretches = self.hub.stretches(max_age=STRETCHES_EVERY)
        if stretches is not self.stretches_seen and ring.head > self.cursor:   # only while records flow
            self.stretches_seen = stretches
            out.append(stretches)
        head = ring.head
        if head - self.cursor > self.buffer:
            skipped = head - self.buffer - self.cursor
            self.dropped += skipped
            self.hub.dropped += skipped
            out.append({"type": "gap", "dropped": skipped, "reason": "viewer fell behind"})
            self.cursor = head - self.buffer
        out.extend(ring.read(self.cursor, head))
        self.cursor = head
        return out

    def close(self):
        self.closed = True
        self._event.set()
        self.hub.unsubscribe(self)


class Broadcaster:
    def __init__(self, ring: RecordRing, buffer: int, max_subscribers: int):
        self.ring, self.buffer, self.max_subscribers = ring, buffer, max_subscribers
        self._subs: set[Subscription] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False
        self._flushed = 0                   # ring head at the last wake-up
        self.dropped = 0                    # records skipped over, all viewers together
        self.describe: Callable[[], dict] = dict   # what a snapshot says about the engine; the service sets it
        self.lesson: dict | None = None     # the last "lesson" message (ServiceFront.announce), for late viewers
        self.meter = StretchMeter()         # the per-setting metrics of the whole run, for late viewers
        self._meter_lock = threading.Lock()
        self._stretches: Entry | None = None
        self._stretches_at = (-1, 0.0)      # (meter steps, monotonic time) when _stretches was made
        self._meter_steps = 0

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)

    def publish(self, obj: dict):
        """Engine thread (or the event loop, for the app's own messages): O(1), whatever the number of
        viewers. Viewers learn of it at the next flush()."""
        self.ring.append(obj)
        with self._meter_lock:              # O(items): the stretch's running numbers
            self.meter.observe(obj)
            self._meter_steps += obj.get("type") == "step"

    def stretches(self, max_age: float = 0.0) -> Entry:
        """The "stretches" message: app/readers/metrics.py stretches() of every step so far, one dict per setting.
        Made again when steps have run since and it is older than max_age seconds; the same Entry
        otherwise (shared by all viewers, serialised once)."""
        steps, made = self._stretches_at
        now = time.monotonic()
        if self._stretches is None or (self._meter_steps != steps and now - made >= max_age):
            with self._meter_lock:
                steps, rows = self._meter_steps, self.meter.stretches()
            self._stretches, self._stretches_at = Entry({"type": "stretches", "stretches": rows}), (steps, now)
        return self._stretches

    def flush(self):
        """Engine thread, once per step (and after commands): one loop wake-up for all new records,
        so viewers send a step's events and its record together instead of waking per record."""
        if self._subs and not self._wake_pending and self._loop is not None and self.ring.head > self._flushed:
            self._flushed = self.ring.head
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._wake_all)
            except RuntimeError:            # the loop has closed: nobody is listening any more
                self._wake_pending = False

    def _wake_all(self):
        self._wake_pending = False
        for sub in self._subs:
            sub.wake()

    def subscribe(self, snapshot_steps: int = 0) -> Subscription:
        """A new viewer; its first get() is a snapshot with the last snapshot_steps steps (0: none)."""
        if len(self._subs) >= self.max_subscribers:
            raise TooManySubscribers(f"too many viewers (the limit is {self.max_subscribers}); try again later")
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.is_closed():
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("all subscribers must live on one event loop")
        sub = Subscription(self, snapshot_steps)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription):
        self._subs.discard(sub)

    def close_all(self):
        for sub in list(self._subs):
            sub.close()

    def close_all_threadsafe(self):
        """close_all() from any thread: it runs on the viewers' event loop."""
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.close_all)
        except RuntimeError:                # that loop has already closed
            pass
