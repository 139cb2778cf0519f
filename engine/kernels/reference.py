"""The torch reference of every CPU op (engine/kernels/ops.py), in the ops' own arguments and layouts.

The elementwise chains are the model's plain path itself (models.llama imports them from here), the one
`BATCHSCOPE_CPU_KERNEL=0` runs; the attention ones read the cache in the kernel's layout inside a block
(engine.execution.backends.CpuAttention), one sequence at a time, so the obvious loop is the definition.
tests/test_kernel_ops.py compares every op with its reference on random shapes."""
from __future__ import annotations

import torch
import torch.nn.functional as F


# ---- the elementwise chains (bf16, fp32; other dtypes run them too) ----
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:        # one op, bit for bit the formula below
        return F.rms_norm(x, weight.shape, weight, eps)
    # 16-bit: computed in fp32 and rounded before the weight, like the reference implementation;
    # in place on the fp32 copy (a new tensor): two temporaries fewer, the same values
    dtype = x.dtype
    x = x.float()
    x.mul_(x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_())
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add fused into the next norm: returns (norm(x + residual), x + residual)."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, heads, head_dim), q's and k's heads together; cos, sin: (num_tokens, 1, head_dim),
    sin with its first half negated, so rotate_half(x) * sin is roll(x) * sin: four ops, not seven, two
    of them in place on the temporaries (the same values as x * cos + roll(x) * sin)."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(sin))


def silu_and_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate).mul_(up)          # into silu's output: one temporary fewer


# ---- the paged cache in the kernel's layout ----
def cache_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, block_size, kv_heads, head_dim) caches -> keys (blocks, kv_heads, head_dim, block_size)
    and values (blocks, kv_heads, block_size, head_dim): how the kernels lay out a block."""
    nb, bs, kvh, d = k_cache.shape
    return k_cache.view(nb, kvh, d, bs), v_cache.view(nb, kvh, bs, d)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """k, v: (tokens, kv_heads, head_dim) -> their slots, in the kernel's layout: one index_put_ each."""
    kt, vt = cache_views(k_cache, v_cache)
    bs = k_cache.shape[1]
    block, off = slot_mapping // bs, slot_mapping % bs
    kt.permute(0, 3, 1, 2).index_put_((block, off), k)       # a (blocks, block_size, kv_heads, head_dim) view
    vt.permute(0, 2, 1, 3).index_put_((block, off), v)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens) -> torch.Tensor:
    """q: (n, heads, head_dim) -> each sequence's attention over its first context_lens[i] cached tokens."""
    kt, vt = cache_views(k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype)
    bs = k_cache.shape[1]
    for i in range(q.shape[0]):
        ctx = int(context_lens[i])
        blocks = block_tables[i, :-(-ctx // bs)]
        keys = kt[blocks].permute(1, 0, 3, 2).reshape(kt.shape[1], -1, kt.shape[2])[:, :ctx]   # (kv_heads, ctx, d)
        vals = vt[blocks].transpose(0, 1).reshape(vt.shape[1], -1, vt.shape[3])[:, :ctx]
        o = F.scaled_dot_product_attention(q[i, :, None].float(), keys.float(), vals.float(), enable_gqa=True)
        out[i] = o[:, 0].to(q.dtype)
    return out


def causal_prefill(q, k, v, m: int) -> torch.Tensor:
    """m fresh chunks of one length side by side, (m * q_len, heads, head_dim) rows -> their causal attention."""
    b = lambda t: t.reshape(m, -1, *t.shape[1:]).transpose(1, 2).float()       # noqa: E731
    o = F.scaled_dot_product_attention(b(q), b(k), b(v), is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape).to(q.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def linear_tiles(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear's bf16 values as oneDNN's AMX tile kernels sum them, the inputs in order (linear_amx's
    reference). A single row takes another oneDNN kernel, which sums in another order, so one row is
    computed beside a zero row: the two orders round the fp32 sum differently, which shows in bf16 only
    where it nearly cancels."""
    if x.shape[0] != 1:
        return F.linear(x, w)
    return F.linear(F.pad(x, (0, 0, 0, 1)), w)[:1]


def decode_layers(x, cos, sin, slot_mapping, block_tables, context_lens, weights: dict, heads: int, kv_heads: int,
                  eps: float):
    """A decode step's layers, the references above in the model's order (models.llama.DecoderLayer), over
    the plain weights: weights holds per-layer lists input_norm, qkv, o, post_norm, gate_up, down (F.linear's
    (out, in)), k_cache, v_cache. Returns (the last layer's output, the residual stream)."""
    d = weights["k_cache"][0].shape[3]
    residual = None
    for l in range(len(weights["qkv"])):
        if residual is None:
            h, residual = rms_norm(x, weights["input_norm"][l], eps), x
        else:
            h, residual = add_rms_norm(x, residual, weights["input_norm"][l], eps)
        qkv = linear(h, weights["qkv"][l]).view(-1, heads + 2 * kv_heads, d)
        qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
        k_cache, v_cache = weights["k_cache"][l], weights["v_cache"][l]
        write_kv(qk[:, heads:], qkv[:, heads + kv_heads:], k_cache, v_cache, slot_mapping)
        o = paged_decode(qk[:, :heads], k_cache, v_cache, block_tables, context_lens)
        h, residual = add_rms_norm(linear(o.flatten(1), weights["o"][l]), residual, weights["post_norm"][l], eps)
        inter = weights["gate_up"][l].shape[0] // 2
        x = linear(silu_and_mul(linear(h, weights["gate_up"][l]), inter), weights["down"][l])
    return x, residual
