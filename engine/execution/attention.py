"""Attention over a flat ragged batch that reads and writes the paged KV cache.

A step's tokens are one flat dimension: first one token per decoding sequence,
then the prefill chunks. Everything attention needs to know about that layout
travels in one per-step AttentionMetadata (set by the model runner, read by
every layer), not through the forward signatures.

Backends share one call: backend(q, k, v, k_cache, v_cache, meta) -> out.
TorchAttention, here, is the plain one (CPU and CUDA) and the reference of the
others: one SDPA call per prefill chunk, or per run of fresh chunks of one
length; decodes in one call per group of similar context lengths, over their
blocks gathered (index_select) and masked. The fast backends (the CPU library's
paged kernels, the Triton kernel, flash-attn) and the choice between them are
in engine/execution/backends.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class PrefillChunk:
    q_start: int               # first row of this chunk in the flat batch
    q_len: int                 # tokens in the chunk
    ctx_len: int               # tokens of the sequence in the cache once the chunk is written
    block_table: torch.Tensor  # (num_blocks,) long
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, None when the chunk starts the sequence


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # (num_tokens,) cache slot of each token
    context_lens: torch.Tensor      # (num_seqs,) tokens in the cache once this step is written; decodes first
    block_tables: torch.Tensor      # (num_seqs, max_blocks) long, rows padded with 0
    num_decodes: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # ragged layout (Triton, flash-attn): cumulative query and context lengths, and their maxima (host ints)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    decode_ctx: list[int] = field(default_factory=list)   # host-side: each decode's context length
    derived: dict = field(default_factory=dict)   # per-step tensors a backend builds in its first layer


_META: AttentionMetadata | None = None


def set_metadata(meta: AttentionMetadata | None):
    global _META
    _META = meta


def get_metadata() -> AttentionMetadata:
    return _META


def write_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor):
    """k, v: (num_tokens, kv_heads, head_dim) -> their slots in (num_blocks, block_size, kv_heads, head_dim)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


# CUDA SDPA kernels without cuDNN's: cuDNN builds an execution plan for every new (q_len, ctx) shape,
# and a serving engine's prefill chunks bring a new shape nearly every step, so planning would cost
# more than the attention itself (docs/gpu.md)
CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """q: (b, heads, q_len, head_dim); k, v: (b, kv_heads, ctx, head_dim)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    if k.shape[1] != q.shape[1]:
        # CUDA SDPA honours enable_gqa only in its flash kernel (16-bit, no mask); elsewhere it falls back
        # to the math kernel and its (q_len, ctx) score matrix per head: expanding K/V is far cheaper
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with sdpa_kernel(CUDA_SDPA):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache: (num_blocks, block_size, kv_heads, head_dim); blocks: (n,) long -> (n * block_size, kv_heads,
    head_dim), the blocks' tokens in order. index_select copies whole blocks (rows of a 2-D view), one
    contiguous copy per block, where indexing the 4-D cache with a tensor gathers element by element."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks).view(-1, *cache.shape[2:])


def batched(t: torch.Tensor, m: int) -> torch.Tensor:
    """(m * q_len, heads, head_dim) rows -> (m, heads, q_len, head_dim), a view."""
    return t.view(m, -1, *t.shape[1:]).transpose(1, 2)


def chunk_runs(chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
    """The step's prefill chunks (consecutive in the flat batch) cut into runs that share one attention
    call: chunks that start their sequences (no mask) and have one length, side by side, are one causal
    call over a (chunks, q_len) view; a chunk that reads earlier tokens from the cache is a run of its
    own. Eight same-length prompts are one call per layer instead of eight: fewer calls, and fewer
    waits for a thread the OS has descheduled, which each call pays once (docs/results.md)."""
    runs: list[list[PrefillChunk]] = []
    for c in chunks:
        last = runs[-1][-1] if runs else None
        if last is not None and c.mask is None and last.mask is None and c.q_len == last.q_len:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def decode_groups(blocks: list[int]) -> list[list[int]]:
    """Decodes (by their number of blocks) in groups that share one padded attention call: sorted longest
    first, a new group starting where a decode has less than half the blocks of its group's longest.
    Padding then costs less than 2x a decode's own context, in few calls (one when lengths are alike)."""
    order = sorted(range(len(blocks)), key=lambda i: -blocks[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and 2 * blocks[i] >= blocks[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class TorchAttention:
    name = "torch-sdpa"
    graphable = False                # decode shapes follow the longest context: no fixed shape to capture

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        # q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim)
        self.write(k, v, k_cache, v_cache, meta)
        if not meta.prefills:
            return self.decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta)
        for run in chunk_runs(meta.prefills):
            c, m = run[0], len(run)
            rows = slice(c.q_start, c.q_start + m * c.q_len)

            if c.mask is None:   # the chunks are their sequences' whole contexts so far: plain causal attention
                out[rows] = self.causal(q[rows], k[rows], v[rows], m)
            else:                # earlier chunks (or cached prefix) come from the paged cache (a run of one)
                o = sdpa(batched(q[rows], m), *self.context(k_cache, v_cache, c), attn_mask=c.mask)
                out[rows] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
        return out

    def causal(self, q, k, v, m: int) -> torch.Tensor:
        """m fresh chunks of one length side by side, (m * q_len, heads, head_dim) rows -> their causal attention."""
        return sdpa(batched(q, m), batched(k, m), batched(v, m), is_causal=True).transpose(1, 2).reshape(q.shape)

    def write(self, k, v, k_cache, v_cache, meta: AttentionMetadata):
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    def context(self, k_cache, v_cache, c: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's whole context from the cache: K and V as (1, kv_heads, ctx_len, head_dim)."""
        kc = gather(k_cache, c.block_table)[:c.ctx_len].transpose(0, 1).unsqueeze(0)
        vc = gather(v_cache, c.block_table)[:c.ctx_len].transpose(0, 1).unsqueeze(0)
        return kc, vc

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """One SDPA call per group of decodes with similar contexts (decode_groups), over their blocks
        gathered and padded to the group's longest, masked. Per-sequence calls over views of the cache
        copy less but cost 2 x layers calls per sequence, and a call's fixed cost outweighs the copy
        (python -m demos.bench.ops; docs/results.md, "Decode attention")."""
        if "decode_groups" not in meta.derived:   # index tensors and masks, built in the first layer
            meta.derived["decode_groups"] = self.plan(meta, k_cache.shape[1], q.device)
        groups = meta.derived["decode_groups"]

        def attend(qg, blocks, mask):
            n, kvh, d = mask.shape[0], k_cache.shape[2], k_cache.shape[3]
            kc = gather(k_cache, blocks).view(n, -1, kvh, d).transpose(1, 2)   # (n, kv_heads, padded ctx, head_dim)
            vc = gather(v_cache, blocks).view(n, -1, kvh, d).transpose(1, 2)
            return sdpa(qg.unsqueeze(2), kc, vc, attn_mask=mask).squeeze(2)
        if len(groups) == 1 and groups[0][0] is None:      # one group, every decode in order
            return attend(q, *groups[0][1:])
        out = torch.empty_like(q)
        for rows, blocks, mask in groups:
            out.index_copy_(0, rows, attend(q.index_select(0, rows), blocks, mask))
        return out

    @staticmethod
    def plan(meta: AttentionMetadata, block_size: int, device) -> list:
        """Per decode group: (its rows, or None for all decodes in order; its blocks' ids, flat, each
        sequence's table cut or padded to the group's longest; the mask of real tokens)."""
        blocks = [-(-c // block_size) for c in meta.decode_ctx]
        plan = []
        for g in decode_groups(blocks):
            width, rows = blocks[g[0]], torch.tensor(g, device=device)
            mask = (torch.arange(width * block_size, device=device)[None]
                    < meta.context_lens[rows][:, None])[:, None, None]   # (n, 1, 1, width * block_size)
            plan.append((None if g == list(range(meta.num_decodes)) else rows,
                         meta.block_tables[rows, :width].flatten(), mask))
        return plan
