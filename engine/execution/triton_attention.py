"""Unified paged attention in Triton: a step's whole ragged batch (decodes, then prefill chunks) in one launch.

Layout (the model runner's flat batch): query tokens in one dimension, sequence s owning rows
cu_q[s]..cu_q[s + 1]; its context (tokens in the cache once this step is written, this step's
included) is seq_lens[s], read straight from the paged cache through block_tables[s].

Each program takes one q-block (BLOCK_Q consecutive query tokens of one sequence) for one KV head:
its BLOCK_Q x GROUP_PAD rows are those tokens times the query heads sharing that KV head
(grouped-query attention in one tile). It walks the context TILE tokens at a time (each token's
block looked up in the block table, so a tile may span several blocks), masks causally inside the
chunk (a token sees the cache up to its own position), and keeps a running softmax. Nothing is
gathered or padded in memory.

The launch grid depends only on padded sizes: num_tokens // BLOCK_Q + num_seqs q-blocks bound the
real ones (each sequence adds at most one partial block). A program finds its sequence by a binary
search over the q-block starts cu_q[s] // BLOCK_Q + s (device-side, from cu_q), and a program past
the real work (a padded token, a padded sequence of length 0) returns at once. So one captured
launch serves any mix of decodes and chunks that fits its padded sizes.

Split-K (flash-decoding): with few sequences and long contexts, one program per (q-block, KV head)
leaves most of the GPU idle, so each program's context tiles are cut into num_splits ranges run in
parallel; a small combine weighs each range's result by its softmax mass (log-sum-exp).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _unified_kernel(out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_q_ptr, seq_lens_ptr,
                    scale, num_seqs, num_splits, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                    stride_ot, stride_oh, stride_osp,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    qblock, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # ---- which sequence: the last s whose first q-block cu_q[s] // BLOCK_Q + s is <= qblock ----
    lo, hi = 0, num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= qblock:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_begin, q_end = tl.load(cu_q_ptr + seq), tl.load(cu_q_ptr + seq + 1)
    first = (qblock - (q_begin // BLOCK_Q + seq)) * BLOCK_Q      # this program's first token, within the sequence
    q_len = q_end - q_begin
    if first >= q_len:                                            # past the real work: padding
        return
    ctx = tl.load(seq_lens_ptr + seq)
    cached = ctx - q_len                                          # tokens before this step's first one

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)                         # rows: token-major, then head
    tok, g = first + r // GROUP_PAD, r % GROUP_PAD
    real = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q_off = (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=real[:, None], other=0.0).to(tl.float32)  # (rows, HEAD_DIM)
    q_pos = cached + tok                                          # each row's position in its sequence

    # context this program needs: up to its last real token's position, causally
    last_pos = cached + tl.minimum(first + BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(last_pos + 1, TILE)
    per_split = tl.cdiv(num_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, num_tiles)

    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)   # running max of the scores
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)     # running sum of exp(score - m) * v
    t = tl.arange(0, TILE)
    for i in range(t_lo, t_hi):
        pos = i * TILE + t
        valid = pos <= last_pos
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv = block[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)   # (TILE, HEAD_DIM)
        v = tl.load(v_cache_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale                  # (rows, TILE)
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing yet in this split
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    l_safe = tl.where(l > 0, l, 1.0)                              # an empty split writes zeros and lse = -inf
    out = out_ptr + (q_begin + tok)[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_osp + d[None, :]
    tl.store(out, acc / l_safe[:, None], mask=real[:, None])
    if SPLIT:
        num_heads = tl.num_programs(1) * GROUP
        lse = tl.where(l > 0, m + tl.log(l_safe), float("-inf"))
        tl.store(lse_ptr + ((q_begin + tok) * num_heads + head) * num_splits + split, lse, mask=real)


def block_q_for(group: int, block_m: int = 16) -> int:
    """Query tokens per program: block_m rows (at least 16, for tl.dot) of GROUP_PAD heads each."""
    return max(1, max(16, block_m) // max(1, triton.next_power_of_2(group)))


def num_qblocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Programs per KV head and split: an upper bound on the q-blocks of any batch of these padded sizes."""
    return num_tokens // block_q + num_seqs


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_q: torch.Tensor, seq_lens: torch.Tensor, num_splits: int = 1, block_m: int = 16,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q: (num_tokens, heads, head_dim), rows past cu_q[-1] padding; caches: (num_blocks, block_size, kv_heads,
    head_dim); block_tables: (num_seqs, >= max blocks) int; cu_q: (num_seqs + 1,) int, padded sequences of length 0;
    seq_lens: (num_seqs,) tokens in the cache, this step's included. Returns (num_tokens, heads, head_dim);
    padding rows are left as they were in `out` (uninitialised if None; zeros with split-K): nothing reads them."""
    n, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    num_seqs = block_tables.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_splits == 1:
        parts, lse, split_stride = out, out, 0
    else:
        parts = torch.zeros((n, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.full((n, heads, num_splits), float("-inf"), dtype=torch.float32, device=q.device)
        split_stride = parts.stride(2)
    bq = block_q_for(group, block_m)
    _unified_kernel[(num_qblocks(n, num_seqs, bq), kv_heads, num_splits)](
        parts, lse, q, k_cache, v_cache, block_tables, cu_q, seq_lens, head_dim ** -0.5, num_seqs, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        parts.stride(0), parts.stride(1), split_stride,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=bq, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE=max(16, min(64, 2048 // head_dim)), SPLIT=num_splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if num_splits > 1:   # each split's result, weighed by its share of the softmax mass (padding rows: 0 / 0)
        w = torch.softmax(lse, dim=-1).nan_to_num_(0.0).unsqueeze(-1)
        out.copy_((parts * w).sum(2))
    return out
