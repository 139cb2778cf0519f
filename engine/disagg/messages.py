"""What the disaggregated router and its two worker processes say to each other.

Each message is a small frozen dataclass, pickled through a multiprocessing queue;
each side dispatches on the message's type (engine/disagg/worker.py,
engine/disagg/router.py), so a message and its handler are found by name.

Pure Python: importing this module does not import torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.scheduling.sequence import Sequence, Status


# ================= router -> worker =================
@dataclass(frozen=True)
class Add:
    """prefill worker: a new request (LLMEngine.add_request's arguments), taken by the router at `arrival`."""
    request: dict
    arrival: float


@dataclass(frozen=True)
class Adopt:
    """decode worker: a request handed over, its KV in the staging `slots` since `t0` (export start)."""
    seq: Sequence
    generator_state: Any             # its sampler's torch.Generator state, None when greedy
    slots: list[int]
    t0: float


@dataclass(frozen=True)
class Release:
    """prefill worker: these staging slots are free again."""
    slots: list[int]


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str


@dataclass(frozen=True)
class Budgets:
    """Both workers: the new budgets (max_num_batched_tokens, max_num_seqs, max_prefill_chunk)."""
    budgets: dict


@dataclass(frozen=True)
class Ask:
    """Tests: report the KV blocks, staging slots and queues, answered with a Reply carrying `key`."""
    key: int


@dataclass(frozen=True)
class Pause:
    """Tests: sleep this long, to catch a request in the middle of a hand-over."""
    seconds: float


@dataclass(frozen=True)
class Stop:
    pass


# ================= worker -> router =================
@dataclass(frozen=True)
class Ready:
    """The model is loaded: pid, threads, num_blocks, max_model_len, device, attention_backend, bytes_per_block."""
    info: dict


@dataclass(frozen=True)
class Progress:
    """What a request gained on the worker since its previous Progress: the router's copy catches up."""
    tokens: list[int]
    times: list[float]
    text: str
    logprobs: list
    first_token_time: float | None
    num_cached_tokens: int
    num_preemptions: int
    status: Status
    finish_reason: str | None
    finish_time: float | None
    error: str | None


@dataclass(frozen=True)
class Out:
    """The records and request events of the worker's last step and commands, and its requests' progress."""
    records: list[dict]
    progress: dict[str, Progress]


@dataclass(frozen=True)
class Exported:
    """prefill worker: the request's KV is in `slots`; `kv_ops` are the frees of its blocks there."""
    seq: Sequence
    generator_state: Any
    slots: list[int]
    t0: float
    kv_ops: tuple


@dataclass(frozen=True)
class Imported:
    """decode worker: the request's KV is in its own blocks since t1 (router clock); the slots are free."""
    request_id: str
    slots: list[int]
    t0: float
    t1: float


@dataclass(frozen=True)
class Dropped:
    """decode worker: an aborted request it had not adopted yet; its slots are free."""
    request_id: str
    slots: list[int]


@dataclass(frozen=True)
class AbortDone:
    """either worker: it has handled the router's Abort; whatever it sent before (an export, an import,
    a drop) has come first, as each worker's messages arrive in order."""
    request_id: str


@dataclass(frozen=True)
class Reply:
    key: int
    value: dict
