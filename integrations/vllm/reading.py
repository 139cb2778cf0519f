"""Reading one vLLM scheduling step as batchscope's records (engine/outputs/records.py).

Pure functions over what the scheduler already holds: its `SchedulerOutput`, the
`Request` objects in `scheduler.requests` and `scheduler.running`, and the block pool's
counters. Nothing here changes vLLM's state, and nothing imports vLLM, so the rules can be
read (and tested) on their own.

A step, as vLLM schedules it (v1 `Scheduler.schedule`): the running requests first, in
their queue order, each getting what it still needs up to the token budget
(`long_prefill_token_threshold` caps one prompt's chunk); then, if nothing was preempted,
waiting requests are admitted while budget, sequence slots and KV blocks last. There is no
prefill or decode phase: a request is a decode in this step when its prompt (and, after a
preemption, its recomputed reply) is already in the cache and the step computes its last
token; anything else is a prefill chunk.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from engine.outputs.records import KVState, StallCause, StepItem

# vLLM's OpenAI server names an engine request `chatcmpl-<id>` or `cmpl-<id>`, where <id> is the
# client's `request_id` (or X-Request-Id header, or a random uuid), then adds `-<8 hex>` of its own
_API_PREFIX = re.compile(r"^(chatcmpl|cmpl)-")
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_UUID = re.compile(r"^[0-9a-f]{32}$")
MAX_LABEL = 32


def label_of(request_id: str) -> str:
    """The name a request is shown under: the id its client sent, without vLLM's additions.
    A client that sent none gets vLLM's random id, shown by its first 8 characters."""
    base = _SUFFIX.sub("", _API_PREFIX.sub("", request_id))
    if _UUID.match(base):
        return base[:8]
    return (base or request_id)[:MAX_LABEL]


def read_before(running: list[Any]) -> dict[str, bool]:
    """Read just before `schedule()`: each running request, in queue order -> it has a reply under way
    (a token produced, or in flight under async scheduling, and no prompt chunk still to compute)."""
    return {r.request_id: r.num_output_tokens + r.num_output_placeholders > 0 and not r.is_prefill_chunk
            for r in running}


def admitted(out: Any) -> set[str]:
    """Requests this step took from a waiting queue: new ones, and preempted ones resumed."""
    return {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.resumed_req_ids)


def item_of(req: Any, n: int, admitted: bool, replying: bool, label: str) -> StepItem:
    """req's part in a step that schedules n of its tokens, read after `schedule()` has moved its
    `num_computed_tokens` on by n. admitted: it came from a waiting queue in this step, so the
    tokens it starts from were served by the prefix cache; replying: read_before's reading."""
    start = req.num_computed_tokens - n
    known = req.num_tokens                          # prompt + reply tokens the scheduler holds
    if replying and start >= known - 1:
        return StepItem(req.request_id, label, "decode", n, start)
    return StepItem(req.request_id, label, "prefill", n, start, prompt_len=known,
                    completes_prompt=start + n >= known,
                    cached=start if admitted and start > 0 else None)


def read_items(out: Any, requests: dict[str, Any], before: dict[str, bool], labels: dict[str, str]
               ) -> tuple[StepItem, ...]:
    """One item per scheduled request, decodes first (each group in vLLM's scheduling order)."""
    new = admitted(out)
    items = [item_of(requests[rid], n, rid in new, before.get(rid, False), labels.get(rid) or label_of(rid))
             for rid, n in out.num_scheduled_tokens.items()]
    return tuple(it for it in items if it.kind == "decode") + tuple(it for it in items if it.kind == "prefill")


def read_drafts(out: Any, model_output: Any, requests: dict[str, Any], num_sampled: int) -> dict[str, tuple[int, int]]:
    """Each request's (drafted, accepted) tokens in this step, counted as vLLM's `update_from_output`
    counts them for its spec-decode statistics; read just before it runs (it drops finished requests).
    drafted: the step's `scheduled_spec_decode_tokens` of the request, less those a grammar refused
    (`num_invalid_spec_tokens`); accepted: the tokens sampled beyond the `num_sampled` every decode
    gives. A request that finished while the step ran (an abort) or sampled nothing has no count."""
    spec = out.scheduled_spec_decode_tokens
    if not spec:
        return {}
    sampled, index = model_output.sampled_token_ids, model_output.req_id_to_index
    invalid = out.num_invalid_spec_tokens or {}
    got = {}
    for rid, drafts in spec.items():
        req = requests.get(rid)
        if not drafts or req is None or req.is_finished() or rid not in index:
            continue
        new = sampled[index[rid]] if sampled else []
        if not new and num_sampled:
            continue
        got[rid] = (len(drafts) - invalid.get(rid, 0), max(len(new) - num_sampled, 0))
    return got


def with_drafts(items: tuple[StepItem, ...], drafts: dict[str, tuple[int, int]]) -> tuple[StepItem, ...]:
    """The step's decode items with their drafted and accepted tokens. A request vLLM admitted from its
    waiting queue with one token left (a full prefix hit, a resumed recompute) may be padded with
    placeholder drafts; it is read as a prefill, which carries no draft counts."""
    if not drafts:
        return items
    return tuple(replace(it, drafted=drafts[it.req][0], accepted=drafts[it.req][1])
                 if it.kind == "decode" and it.req in drafts else it for it in items)


def read_stalls(out: Any, before: dict[str, bool], budget: int) -> tuple[tuple[str, ...], tuple[StallCause, ...]]:
    """The replying requests the step left out, and why. vLLM leaves a running request out when the
    token budget is spent before its turn (`budget`), or when no KV block could be found for it even
    after preempting (`kv_full`; the loop stops there). A request left out for a rule the recorder
    does not model (async scheduling's in-flight tokens reaching max_tokens, pipeline stages) is not
    a stall and is not listed."""
    scheduled, preempted = out.num_scheduled_tokens, out.preempted_req_ids or set()
    spent = out.total_num_scheduled_tokens >= budget
    stalled, causes = [], []
    for rid in (r for r, replying in before.items() if replying):
        if rid in scheduled or rid in preempted or rid in out.finished_req_ids:
            continue
        cause = "budget" if spent else "kv_full" if preempted else None
        if cause is not None:
            stalled.append(rid)
            causes.append(StallCause(rid, cause))
    return tuple(stalled), tuple(causes)


def read_kv(block_pool: Any, block_size: int) -> KVState:
    """The block pool's counts. vLLM keeps one block aside (the null block): it is not counted."""
    total = block_pool.num_gpu_blocks - 1
    used = total - block_pool.get_num_free_blocks()
    return KVState(used, total, len(block_pool.cached_block_hash_to_block), block_size)
