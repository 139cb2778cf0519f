"""What the engine publishes: one StepRecord per forward pass, request events and policy events.

Each record is a frozen dataclass; `to_dict()` gives the JSON object on the wire
(docs/step_record.md), once per record: Listeners hands each reader a copy of its
top level, to add its own fields to without touching another reader's.
Field names are a contract read by app/, demos/ and static/: add, never rename.
Every field carries its one-line meaning; `record_fields()` lists the names per
record type and `schema_markdown()` writes the tables of docs/step_record.md.

Pure Python: importing this module does not import torch.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from engine.scheduling.block_manager import BlockManager
    from engine.scheduling.scheduler import Batch, Scheduler
    from engine.scheduling.sequence import Sequence

log = logging.getLogger("batchscope.engine")


def doc(meaning: str, default: Any = dataclasses.MISSING, optional: bool = False):
    """A field with its meaning. optional: left out of the wire dict when None."""
    meta = {"doc": meaning, "optional": optional}
    if optional and default is dataclasses.MISSING:
        default = None
    return field(default=default, metadata=meta)


class Record:
    """Shared serialisation: nested records become dicts, optional None fields are left out."""

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            out[f.name] = _plain(value)
        return out


def _plain(value):
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---- a step and its parts ----
@dataclass(frozen=True)
class StepItem(Record):
    req: str = doc("request id")
    label: str = doc("the request's display label")
    kind: str = doc("`decode` (one new token of a running reply, with any drafted tokens it verifies) or "
                    "`prefill` (a chunk of prompt, or a recompute after preemption)")
    tokens: int = doc("tokens this sequence contributed to the pass")
    start: int = doc("position of the first of those tokens in the sequence")
    prompt_len: int | None = doc("prefill only: tokens to prefill in all (prompt, or prompt + output "
                                 "when recomputing)", optional=True)
    completes_prompt: bool | None = doc("prefill only: this chunk finishes the prompt, so the step also "
                                        "samples this request's first token", optional=True)
    cached: int | None = doc("prefill only, first chunk: prompt tokens served from the prefix cache "
                             "instead of computed", optional=True)
    drafted: int | None = doc("speculative decoding, a decode verifying drafts only: drafted tokens it ran "
                              "after its own (`tokens` = 1 + `drafted`)", optional=True)
    accepted: int | None = doc("with `drafted`: of those, the ones the model agreed with, kept in the reply "
                               "(the step gave it `accepted` + 1 tokens; the KV of the other "
                               "`drafted - accepted` was rolled back; a stop among them ends the reply "
                               "there and drops the rest)", optional=True)

    @classmethod
    def of(cls, seq: Sequence, n: int) -> StepItem:
        """seq's part in a step about to run n of its tokens (read before the step changes it)."""
        start = seq.num_computed_tokens
        if seq.is_prefill_done:
            return cls(seq.id, seq.label, "decode", n, start, drafted=n - 1 if n > 1 else None)
        first_chunk = seq.num_cached_tokens and start == seq.num_cached_tokens
        return cls(seq.id, seq.label, "prefill", n, start, prompt_len=seq.num_tokens,
                   completes_prompt=start + n == seq.num_tokens,
                   cached=seq.num_cached_tokens if first_chunk else None)


@dataclass(frozen=True)
class KVState(Record):
    used: int = doc("KV blocks in use by live requests")
    total: int = doc("KV blocks in the cache")
    cached: int = doc("blocks holding prefix-cached content (in use or free but not yet reused)")
    block_size: int = doc("tokens per block")
    limit: int | None = doc("blocks that may be in use at once, when `max_kv_blocks` caps them below `total`",
                            optional=True)

    @classmethod
    def of(cls, bm: BlockManager) -> KVState:
        return cls(bm.num_used, bm.num_blocks, bm.num_cached, bm.block_size, bm.max_kv_blocks)


def kv_ops(bm: BlockManager) -> tuple[KVOp, ...] | None:
    """The block manager's changes since the last call (its log emptied), None when none."""
    if not bm.log:
        return None
    ops = tuple(KVOp(*entry) for entry in bm.log)
    bm.log.clear()
    return ops


def kv_map(bm: BlockManager, seqs: Iterable[Sequence]) -> tuple[KVBlock, ...]:
    """Every block held by one of seqs (the running ones) or cached, by block id."""
    holders: dict[int, list[str]] = {}
    for seq in seqs:
        for block_id in seq.block_table:
            holders.setdefault(block_id, []).append(seq.id)
    bm.map_due = False
    return tuple(KVBlock(b.id, tuple(holders.get(b.id, ())), b.hash is not None)
                 for b in bm.blocks if b.id in holders or b.hash is not None)


STALL_CAUSES = ("prefill", "static_batch", "budget", "no_slot", "kv_full", "policy")


@dataclass(frozen=True)
class StallCause(Record):
    req: str = doc("the running request left out of the step (one of the step's `stalled`)")
    cause: str = doc("why the scheduler left it out: `prefill` (continuous: a whole prompt ran first), "
                     "`static_batch` (static: the batch's members were still prefilling), "
                     "`budget` (the token budget was spent), `no_slot` (`max_num_seqs` reached), `kv_full` "
                     "(vLLM: no KV block was free for its next token, even after preempting) or `policy` "
                     "(a policy of one's own left it out with room to spare, engine/scheduling/policy.py)")
    by: str | None = doc("prefill and static_batch: the request whose prompt took the step (its largest chunk)",
                         optional=True)
    by_tokens: int | None = doc("prefill and static_batch: that request's tokens in the step", optional=True)

    def __post_init__(self):
        if self.cause not in STALL_CAUSES:
            raise ValueError(f"stall cause must be one of {STALL_CAUSES}, got {self.cause!r}")


KV_OPS = ("alloc", "share", "free", "commit")
KV_MAP_EVERY = 32      # a step whose index is a multiple of this carries the whole map (`kv_map`)


@dataclass(frozen=True)
class KVOp(Record):
    op: str = doc("`alloc` (a free block taken by `req`; any cached content in it is evicted), `share` "
                  "(a prefix-cache hit: `req` holds it too), `free` (`req` lets go; with no holder left "
                  "the block is free, and cached if it was committed), `commit` (full: its content is now cached)")
    block: int = doc("physical block id")
    req: str = doc("the request")


@dataclass(frozen=True)
class KVBlock(Record):
    block: int = doc("physical block id")
    holders: tuple[str, ...] = doc("requests holding it (its ref count is their number; none: free)")
    cached: bool = doc("it holds committed, reusable content (a free one is evictable)")


@dataclass(frozen=True)
class StepTiming(Record):
    schedule: float = doc("seconds in the scheduler: choosing the batch (and any preemption)")
    items: float = doc("seconds building the record's items from the batch (between `t_start` and `t_end`)")
    forward: float = doc("seconds in the forward pass, sampling and the requests' bookkeeping after it")
    record: float = doc("seconds assembling the record after `t_end`")


@dataclass(frozen=True)
class StepRecord(Record):
    type: ClassVar[str] = "step"
    step: int = doc("step index, from 0, never reused")
    t_start: float = doc("when the step began (before scheduling)")
    t_end: float = doc("when its forward pass, sampling and bookkeeping ended: "
                       "`t_end - t_start` = `timing.schedule + timing.items + timing.forward`")
    policy: str = doc("`static`, `continuous`, `chunked` or `disaggregated`: the policy that built this step "
                      "(or the `name` of a policy of one's own, engine/scheduling/policy.py)")
    token_budget: int = doc("`max_num_batched_tokens` in force for this step")
    max_num_seqs: int = doc("most sequences allowed in one step")
    items: tuple[StepItem, ...] = doc("one entry per sequence in the forward pass, decodes first")
    num_tokens: int = doc("sum of `items[].tokens`")
    finished: tuple[str, ...] = doc("requests that finished in this step (EOS, stop, length)")
    preempted: tuple[str, ...] = doc("requests preempted (KV freed, to be recomputed) while building this step")
    stalled: tuple[str, ...] = doc("running requests that had a reply under way but were left out of this step")
    stall_causes: tuple[StallCause, ...] = doc("one entry per `stalled` request, in that order: why the scheduler "
                                               "left it out")
    kv: KVState = doc("paged KV cache after the step")
    waiting: int = doc("requests waiting for admission after the step")
    running: int = doc("requests admitted (holding KV) after the step")
    failed: bool = doc("the forward pass raised: every request in `items` failed and nothing was computed")
    error: str | None = doc("failed steps only: the exception's class name", optional=True)
    timing: StepTiming | None = doc("where the step's time went", optional=True)
    kv_ops: tuple[KVOp, ...] | None = doc("block changes since the previous step record, in order "
                                          "(left out when none)", optional=True)
    kv_map: tuple[KVBlock, ...] | None = doc(f"every {KV_MAP_EVERY}th step, and the step after the prefix "
                                             "cache was reset: every block held or cached after the step, so a "
                                             "reader that joins late (or a reset's silent evictions) starts from it",
                                             optional=True)
    device: str | None = doc("`device/dtype` of the forward pass (`cpu/float32`, `cuda/bfloat16`): step costs "
                             "are fitted per device and dtype", optional=True)
    worker: str | None = doc("`disaggregated` only: the worker process that ran the step, `prefill` or `decode` "
                             "(both on one clock; `step` numbers the two workers' steps together, in the order "
                             "the router relayed them)", optional=True)
    worker_step: int | None = doc("`disaggregated` only: the step's index among its own worker's steps",
                                  optional=True)
    threads: int | None = doc("`disaggregated` only: torch threads of the worker that ran the step (its share "
                              "of the cores)", optional=True)
    lane: int | None = doc("a vLLM server with several data-parallel engines only: the engine (its data-parallel "
                           "rank) that ran the step; each engine schedules its own requests", optional=True)
    lane_step: int | None = doc("with `lane`: the step's index among its own engine's steps", optional=True)
    speculative: int | None = doc("speculative decoding in force for this step: the most tokens drafted per "
                                  "reply (`num_speculative_tokens`); left out when off. Part of the setting: "
                                  "a change of it starts a new stretch of the metrics table", optional=True)
    prefix_caching: bool | None = doc("`false` when prefix caching was off for this step (left out when on): "
                                      "a stretch of steps runs under one setting of it", optional=True)
    max_prefill_chunk: int | None = doc("the cap on one request's prefill chunk in force for this step "
                                        "(`max_prefill_chunk`); left out when there is none. Part of the setting: "
                                        "a change of it starts a new stretch of the metrics table", optional=True)

    def to_dict(self) -> dict:
        return {"type": self.type, **super().to_dict()}


# ---- events ----
REQUEST_EVENTS = ("arrived", "first_token", "finished", "aborted", "preempted", "kv_transfer")


@dataclass(frozen=True)
class RequestEvent(Record):
    type: ClassVar[str] = "request"
    event: str = doc("`arrived`, `first_token`, `finished`, `aborted`, `preempted` or `kv_transfer` "
                     "(`disaggregated`: the request's KV moved from the prefill worker to the decode worker)")
    req: str = doc("request id")
    label: str = doc("the request's display label")
    t: float = doc("when it happened")
    prompt_len: int | None = doc("arrived: prompt tokens", optional=True)
    max_tokens: int | None = doc("arrived: most reply tokens asked for", optional=True)
    ttft: float | None = doc("first_token: seconds from arrival to the first token", optional=True)
    finish_reason: str | None = doc("finished: `stop` or `length`; aborted: `abort` (a client or the server "
                                    "stopped it) or `error` (it failed)", optional=True)
    output_tokens: int | None = doc("finished: reply tokens", optional=True)
    reason: str | None = doc("aborted: why (the client's reason, or the error that failed it)", optional=True)
    step: int | None = doc("preempted: the step being built when it was preempted", optional=True)
    blocks: int | None = doc("kv_transfer: KV blocks moved", optional=True)
    bytes: int | None = doc("kv_transfer: bytes of KV moved (keys and values of every layer)", optional=True)
    seconds: float | None = doc("kv_transfer: from the start of the export on the sending worker to the end of "
                                "the import on the receiving one (`t` is that end)", optional=True)
    from_worker: str | None = doc("kv_transfer: the worker that computed the prompt (`prefill`)", optional=True)
    to_worker: str | None = doc("kv_transfer: the worker that decodes the reply (`decode`)", optional=True)
    kv_ops: tuple[KVOp, ...] | None = doc("kv_transfer: the sending worker's block changes of the hand-over (it "
                                          "frees the request's blocks, which stay prefix-cached there), at the "
                                          "export's start; no step record of that worker carries them",
                                          optional=True)

    def __post_init__(self):
        if self.event not in REQUEST_EVENTS:
            raise ValueError(f"request event must be one of {REQUEST_EVENTS}, got {self.event!r}")

    def to_dict(self) -> dict:
        return {"type": self.type, **super().to_dict()}


@dataclass(frozen=True)
class PolicyEvent(Record):
    type: ClassVar[str] = "policy"
    step: int = doc("the first step built with these settings")
    t: float = doc("when the settings changed")
    policy: str = doc("`static`, `continuous`, `chunked` or `disaggregated`")
    max_num_batched_tokens: int = doc("token budget of one step")
    max_num_seqs: int = doc("most sequences in one step")
    max_prefill_chunk: int | None = doc("cap on one request's prefill chunk; null: no cap")
    enable_prefix_caching: bool = doc("full blocks are cached and reused by later prompts that start alike "
                                      "(switched off: the cache's table is dropped)", default=True)
    max_kv_blocks: int | None = doc("cap on the KV blocks in use (below `kv.total`: memory pressure); "
                                    "null: every block", default=None)
    engine: str | None = doc("records from another serving engine: its name and version (`vllm 0.32.0`); "
                             "left out for batchscope's own", optional=True)
    speculative_config: dict | None = doc("speculative decoding in force, in vLLM's form (`method`, "
                                          "`num_speculative_tokens`, `prompt_lookup_max`, `prompt_lookup_min`); "
                                          "null: off", default=None)

    def to_dict(self) -> dict:
        return {"type": self.type, **super().to_dict()}


# ---- the schema, for tests and docs ----
RECORD_TYPES: dict[str, type[Record]] = {
    "step": StepRecord, "item": StepItem, "stall": StallCause, "kv": KVState, "kv_op": KVOp, "kv_block": KVBlock,
    "timing": StepTiming,
    "request": RequestEvent, "policy": PolicyEvent,
}


def record_fields() -> dict[str, tuple[str, ...]]:
    """Field names per record type ("step", "item", "stall", "kv", "kv_op", "kv_block", "timing",
    "request", "policy"),
    as they appear on the wire (the top-level types include `type`)."""
    out = {}
    for name, cls in RECORD_TYPES.items():
        names = tuple(f.name for f in dataclasses.fields(cls))
        out[name] = (("type",) if hasattr(cls, "type") else ()) + names
    return out


def schema_markdown() -> str:
    """The field tables of docs/step_record.md, one per record type."""
    parts = []
    for name, cls in RECORD_TYPES.items():
        parts.append(f"### `{name}` ({cls.__name__})\n\n| field | meaning |\n|---|---|")
        if hasattr(cls, "type"):
            parts.append(f"| `type` | always `\"{cls.type}\"` |")
        for f in dataclasses.fields(cls):
            note = " (left out when absent)" if f.metadata.get("optional") else ""
            parts.append(f"| `{f.name}` | {f.metadata['doc']}{note} |")
        parts.append("")
    return "\n".join(parts)


# ---- building a step's record, and handing records out ----
Before = tuple[tuple[StepItem, ...], tuple[str, ...], tuple[StallCause, ...]]


def read_batch(batch: Batch, running: Iterable[Sequence]) -> Before:
    """(items, stalled, stall causes) of a batch about to run, read before the step moves its sequences on.
    stalled: running requests with a reply under way that the scheduler left out of the batch."""
    items = tuple(StepItem.of(seq, n) for seq, n in batch.items)
    stalled = tuple(s.id for s in running if s.is_prefill_done and s not in batch)
    return items, stalled, tuple(StallCause(rid, *batch.left_out[rid]) for rid in stalled)


def step_record(step: int, sched: Scheduler, batch: Batch, before: Before, finished: list[str],
                error: str | None, times: tuple[float, float, float, float], clock: Callable[[], float],
                device: str, speculative: int | None = None) -> StepRecord:
    """The record of a step that has run. before: read_batch's reading; times: (start, scheduled,
    items read, end) on `clock`, which also times this assembly (`timing.record`)."""
    items, stalled, causes = before
    items = tuple(dataclasses.replace(it, accepted=batch.accepted.get(it.req, 0)) if it.drafted else it
                  for it in items)                 # what verification kept, known only now
    t_start, t_sched, t_items, t_end = times
    bm = sched.bm
    fields = dict(step=step, t_start=t_start, t_end=t_end, policy=sched.policy, token_budget=sched.token_budget,
                  max_num_seqs=sched.max_num_seqs, items=items, num_tokens=batch.num_tokens,
                  finished=tuple(finished), preempted=tuple(s.id for s in batch.preempted), stalled=stalled,
                  stall_causes=causes, kv=KVState.of(bm), waiting=len(sched.waiting), running=len(sched.running),
                  failed=error is not None, error=error, kv_ops=kv_ops(bm),
                  kv_map=kv_map(bm, sched.running) if step % KV_MAP_EVERY == 0 or bm.map_due else None,
                  prefix_caching=None if bm.enable_prefix_caching else False,
                  max_prefill_chunk=sched.max_prefill_chunk)
    timing = StepTiming(schedule=t_sched - t_start, items=t_items - t_sched, forward=t_end - t_items,
                        record=clock() - t_end)
    return StepRecord(**fields, timing=timing, device=device, speculative=speculative)


class Listeners:
    """Who hears the records. A record becomes a dict once (emit returns it, for StepOutputs); each
    listener gets a copy of its top level, so it may add or replace fields of its own (the server adds
    `step_delay` to a policy event) but must leave the nested items and kv as they are. One that raises is
    logged and removed, so a broken reader cannot stop the engine."""

    def __init__(self):
        self.fns: list[Callable[[dict], None]] = []

    def __bool__(self) -> bool:
        return bool(self.fns)

    def subscribe(self, fn: Callable[[dict], None]):
        self.fns.append(fn)

    def unsubscribe(self, fn: Callable[[dict], None]):
        if fn in self.fns:
            self.fns.remove(fn)

    def emit(self, record: Record | dict) -> dict:
        """record: a Record, or the dict of one relayed from another process (the pair's workers)."""
        obj = record.to_dict() if isinstance(record, Record) else record
        for fn in list(self.fns):
            try:
                fn(dict(obj))
            except Exception:
                log.exception("a step listener failed; it is removed")
                self.unsubscribe(fn)
        return obj


if __name__ == "__main__":
    print(schema_markdown())
