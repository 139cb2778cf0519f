"""Paged decode attention in Triton: one query token per sequence, K/V read straight from the paged cache.

Each program takes one sequence, one KV head and one split of that sequence's tokens. It loads the
GROUP query heads that share the KV head (grouped-query attention) as one tile, walks the context
TILE tokens at a time (each token's block looked up in the block table, so one tile can span several
blocks and many loads are in flight), and keeps a running softmax (flash-attention style): no K/V
is ever gathered into a copy or padded.
The launch shape depends only on the number of sequences, never on their lengths: a decode step
can be captured once in a CUDA graph and replayed for any context lengths.

Split-K (flash-decoding): with few sequences and long contexts, one program per (sequence, KV head)
leaves most of the GPU idle, so each sequence's tiles are cut into num_splits ranges computed in
parallel; a small combine step weighs each range's result by its softmax mass (log-sum-exp).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         scale, num_splits, stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                         stride_os, stride_oh, stride_osp,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(ctx, TILE)
    per_split = tl.cdiv(num_tiles, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_tiles)

    g, d, t = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
    head = kv_head * GROUP + g
    real = g < GROUP                                    # GROUP_PAD >= 16 rows for tl.dot; the rest are zeros
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :], mask=real[:, None], other=0.0)
    q = q.to(tl.float32)   # dots in fp32 (tf32 for 16-bit caches: exact for bf16 inputs, finer for p)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)   # running max of the scores
    l = tl.zeros([GROUP_PAD], tl.float32)                # running sum of exp(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)    # running sum of exp(score - m) * v
    for i in range(lo, hi):
        pos = i * TILE + t                                # TILE tokens, spanning one or several blocks
        valid = pos < ctx
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)  # int64
        kv = block[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)   # (TILE, HEAD_DIM)
        v = tl.load(v_cache_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale       # (GROUP_PAD, TILE)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    l_safe = tl.where(l > 0, l, 1.0)                   # an empty split writes zeros and lse = -inf
    out = out_ptr + seq * stride_os + head[:, None] * stride_oh + split * stride_osp + d[None, :]
    tl.store(out, acc / l_safe[:, None], mask=real[:, None])
    if SPLIT:
        num_heads = tl.num_programs(1) * GROUP
        tl.store(lse_ptr + (seq * num_heads + head) * num_splits + split, m + tl.log(l_safe), mask=real)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, num_splits: int = 1) -> torch.Tensor:
    """q: (n, heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim);
    block_tables: (n, >= max blocks) int64; context_lens: (n,) tokens in the cache, this step's included."""
    n, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    if num_splits == 1:
        parts, lse, split_stride = out, out, 0
    else:
        parts = torch.empty((n, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((n, heads, num_splits), dtype=torch.float32, device=q.device)
        split_stride = parts.stride(2)
    _paged_decode_kernel[(n, kv_heads, num_splits)](
        parts, lse, q, k_cache, v_cache, block_tables, context_lens, head_dim ** -0.5, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        parts.stride(0), parts.stride(1), split_stride,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE=max(16, min(64, 2048 // head_dim)), SPLIT=num_splits > 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if num_splits > 1:   # each split's result, weighed by its share of the softmax mass
        out.copy_((parts * torch.softmax(lse, dim=-1).unsqueeze(-1)).sum(2))
    return out

