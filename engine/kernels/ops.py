"""The CPU kernels registered as torch ops (`torch.ops.batchscope.<name>`, torch.library): each body checks
its arguments (engine/kernels/checks.py), then makes one ctypes call of cpu_kernels.cpp. The schema says
what an op writes (`Tensor(a!)`); everything else it only reads. engine/kernels/cpu_kernels.py is the
interface the core calls; engine/kernels/reference.py holds each op's torch reference."""
from __future__ import annotations

import ctypes

import torch
from torch.library import Library

from engine.kernels import checks as c
from engine.kernels import loading as k

FLOAT = (torch.float32, torch.bfloat16)
LIB = Library("batchscope", "DEF")
# each op's C function per dtype (cpu_kernels.cpp's names: the chains and the causal kernel per dtype suffix)
NORM, SILU, ROPE, CAUSAL = ({dt: f"{op}_{sfx}" for dt, sfx in k.CHAINS.items()}
                            for op in ("rms_norm", "silu_and_mul", "rope", "causal_prefill"))


def op(schema: str):
    """Define `batchscope::<schema>` with the decorated function as its CPU kernel."""
    def register(fn):
        LIB.define(schema)
        LIB.impl(schema.split("(")[0], fn, "CPU")
        return fn
    return register


# ---- attention over the paged cache ----
def cache_pair(k_cache, v_cache, dtype) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, kv_heads, head_dim) of two contiguous caches of one shape and `dtype`."""
    c.tensor("k_cache", k_cache, 4, dtype)
    c.contiguous("k_cache", k_cache)
    c.tensor("v_cache", v_cache, 4, dtype)
    c.contiguous("v_cache", v_cache)
    c.shape("v_cache", v_cache, k_cache.shape)
    return k_cache.shape


def index_tables(n: int, block_tables, context_lens, num_blocks: int, block_size: int):
    """block_tables (int64, (>= n, width), each row packed) names blocks of the cache, and context_lens
    (int64, (>= n,), contiguous) fit their rows: 1 .. width * block_size tokens."""
    c.tensor("block_tables", block_tables, 2, torch.long)
    c.tensor("context_lens", context_lens, 1, torch.long)
    c.contiguous("context_lens", context_lens)
    (tables, width), lens = block_tables.shape, context_lens.shape[0]
    if tables < n or lens < n:
        c.fail("block_tables" if tables < n else "context_lens", f"has {min(tables, lens)} rows for {n} sequences")
    if width > 1 and block_tables.stride(1) != 1:
        c.fail("block_tables", f"each row must be packed (strides {block_tables.stride()})")
    # the whole tensors (the runner's rows beyond the decodes are valid too): the same objects in every layer
    c.ids("block_tables", block_tables, 0, num_blocks, "the cache's num_blocks")
    c.ids("context_lens", context_lens, 1, width * block_size + 1,
          "a row of the table holds its width * block_size tokens, and at least one")


@op("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens) -> Tensor")
def paged_decode(q, k_cache, v_cache, block_tables, context_lens):
    """q: (n, heads, head_dim), rows may be strided; caches: (num_blocks, block_size, kv_heads, head_dim) in
    the kernel's layout; block_tables: (>= n, width) int64; context_lens: (>= n,) int64 -> (n, heads, head_dim).
    Block ids and context lengths are checked against the cache (a min and a max each), once per tensor
    and bound (checks.ids): a step's layers share them."""
    c.tensor("q", q, 3, FLOAT)
    nb, bs, kvh, d = cache_pair(k_cache, v_cache, q.dtype)
    n, heads, q_d = q.shape
    if q_d != d:
        c.fail("q", f"must have shape (*, *, {d}), has {tuple(q.shape)}")
    c.inner_rows("q", q)
    c.divides("kv_heads", kvh, heads, "q's heads")
    if (bs, d) not in k.SHAPES:
        c.fail("k_cache", f"paged_decode has no kernel for block_size {bs} and head_dim {d} ({sorted(k.SHAPES)})")
    index_tables(n, block_tables, context_lens, nb, bs)
    out = torch.empty(n, heads, d, dtype=q.dtype)
    if n:
        k.function("paged_decode", k.FUNCTIONS[q.dtype])(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), n, heads, kvh, d, bs, d ** -0.5,
            k.threads())
    return out


@op("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()")
def write_kv(key, value, k_cache, v_cache, slot_mapping):
    """k, v: (tokens, kv_heads, head_dim), rows may be strided -> their slots (tokens,) int64, in paged_decode's
    block layout. Slots are checked against the cache's num_blocks * block_size, once per tensor (checks.ids)."""
    c.tensor("k", key, 3, FLOAT)
    nb, bs, kvh, d = cache_pair(k_cache, v_cache, key.dtype)
    c.tensor("v", value, 3, key.dtype)
    for name, t in (("k", key), ("v", value)):
        c.shape(name, t, (None, kvh, d))
        c.inner_rows(name, t)
    c.shape("v", value, key.shape)
    c.tensor("slot_mapping", slot_mapping, 1, torch.long)
    c.shape("slot_mapping", slot_mapping, (key.shape[0],))
    slots = slot_mapping.contiguous()
    c.ids("slot_mapping", slots, 0, nb * bs, "the cache's num_blocks * block_size slots")
    if key.shape[0]:
        k.function("write_kv", "write_kv_16" if key.element_size() == 2 else "write_kv_32")(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), key.shape[0], kvh, d, bs, k.threads())


@op("causal_prefill(Tensor q, Tensor k, Tensor v, int m) -> Tensor")
def causal_prefill(q, key, value, m):
    """m fresh prompt chunks of one length side by side: q (m * q_len, heads, head_dim), k and v (m * q_len,
    kv_heads, head_dim), fp32 or bf16 (computed in fp32), rows may be strided -> (m * q_len, heads, head_dim)."""
    c.tensor("q", q, 3, FLOAT)
    rows, heads, d = q.shape
    c.tensor("k", key, 3, q.dtype)
    c.tensor("v", value, 3, q.dtype)
    kvh = key.shape[1]
    for name, t in (("q", q), ("k", key), ("v", value)):
        c.shape(name, t, (rows, heads if name == "q" else kvh, d))
        c.inner_rows(name, t)
    c.divides("kv_heads", kvh, heads, "q's heads")
    if m <= 0 or rows % m:
        c.fail("m", f"{m} chunks do not split {rows} rows evenly")
    if d not in (64, 128) or not k.avx512():
        c.fail("q", f"causal_prefill has no kernel for head_dim {d} in this build (64 and 128, on AVX-512)")
    out = q.new_empty(rows, heads, d)
    if rows:
        k.function("causal_prefill", CAUSAL[q.dtype])(
            q.data_ptr(), q.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            out.data_ptr(), m, rows // m, heads, kvh, d, d ** -0.5, k.threads())
    return out


# ---- elementwise chains ----
def rows_of(name: str, x, weight) -> torch.Tensor:
    """x as contiguous (rows, hidden): itself where it already is (the hidden states), else a copy."""
    c.tensor(name, x, None, FLOAT)
    if x.dim() < 1 or x.shape[-1] == 0:
        c.fail(name, f"needs a last dimension to normalise over, has shape {tuple(x.shape)}")
    c.tensor("weight", weight, 1, x.dtype)
    c.shape("weight", weight, (x.shape[-1],))
    if x.dim() == 2 and x.is_contiguous():
        return x
    return x.reshape(-1, x.shape[-1]).contiguous()


def norm_call(x, residual, weight, eps, out, total):
    if x.shape[0]:
        k.function("rms_norm", NORM[x.dtype])(
            x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.contiguous().data_ptr(),
            out.data_ptr(), 0 if total is None else total.data_ptr(), x.shape[0], x.shape[1], eps, k.threads())


def like(out, x):
    """out, (rows, hidden), in x's shape (a view; itself where x is 2-D)."""
    return out if x.dim() == 2 else out.view(x.shape)


@op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
def rms_norm(x, weight, eps):
    """norm(x) over the last dim; bf16 or fp32; weight: (hidden,)."""
    flat = rows_of("x", x, weight)
    out = torch.empty_like(flat)
    norm_call(flat, None, weight, eps, out, None)
    return like(out, x)


@op("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)")
def add_rms_norm(x, residual, weight, eps):
    """(norm(x + residual), x + residual) over the last dim; residual: x's shape and dtype."""
    flat = rows_of("x", x, weight)
    c.tensor("residual", residual, None, x.dtype)
    c.shape("residual", residual, x.shape)
    res = residual if residual.dim() == 2 and residual.is_contiguous() else residual.reshape(flat.shape).contiguous()
    out, total = torch.empty_like(flat), torch.empty_like(flat)
    norm_call(flat, res, weight, eps, out, total)
    return like(out, x), like(total, x)


@op("silu_and_mul(Tensor gate_up, int inter) -> Tensor")
def silu_and_mul(gate_up, inter):
    """(rows, 2 * inter) = [gate | up] -> silu(gate) * up, (rows, inter)."""
    c.tensor("gate_up", gate_up, 2, FLOAT)
    if inter <= 0 or gate_up.shape[1] != 2 * inter:
        c.fail("inter", f"{inter} is not half of gate_up's width {gate_up.shape[1]}")
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], inter)
    if gate_up.shape[0]:
        k.function("silu_and_mul", SILU[gate_up.dtype])(
            gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, k.threads())
    return out


def rope_table(name: str, t, rows: int, d: int, dtype) -> torch.Tensor:
    """cos or sin: (rows, 1, head_dim) or (rows, head_dim), one row per position of x."""
    c.tensor(name, t, None, dtype)
    if t.dim() not in (2, 3) or t.shape[0] != rows or t.shape[-1] != d or t.numel() != rows * d:
        c.fail(name, f"must have one row of {d} per position ({rows}, 1, {d}), has shape {tuple(t.shape)}")
    return t.contiguous()


@op("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")
def rope(x, cos, sin):
    """x: (rows, heads, head_dim), rows may be strided; cos, sin: (rows, 1, head_dim) -> a new contiguous x."""
    c.tensor("x", x, 3, FLOAT)
    rows, heads, d = x.shape
    if d % 2:
        c.fail("x", f"head_dim {d} must be even (RoPE rotates its halves)")
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    cos, sin = rope_table("cos", cos, rows, d, x.dtype), rope_table("sin", sin, rows, d, x.dtype)
    out = x.new_empty(rows, heads, d)
    if out.numel():
        k.function("rope", ROPE[x.dtype])(
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, heads, d, k.threads())
    return out


# ---- linears over weights laid out once for their kernel ----
@op("pack_amx(Tensor w) -> Tensor")
def pack_amx(w):
    """w: (out, in) bf16, out a multiple of 16 and in of 32 -> the same values in the tile layout, (out, in)."""
    c.tensor("w", w, 2, torch.bfloat16)
    if not k.amx_shape_ok(*w.shape):
        c.fail("w", f"the tile layout needs out a multiple of 16 and in of 32, has shape {tuple(w.shape)}")
    w = w.contiguous()
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    k.lib_or_fail("pack_amx").pack_amx_bf16(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())
    return out


def linear_args(x, packed, out_features, dtype, name: str):
    c.tensor("x", x, 2, dtype)
    c.tensor("packed", packed, 2, dtype)
    c.contiguous("packed", packed)
    if packed.shape[0] != out_features:
        c.fail("out_features", f"{out_features}, but the packed weight has {packed.shape[0]} outputs")
    if packed.shape[1] != x.shape[1]:
        c.fail("x", f"has {x.shape[1]} features, the packed weight takes {packed.shape[1]}")
    if out_features % 16 or out_features == 0:
        c.fail("packed", f"{name} needs a multiple of 16 outputs, has {out_features}")
    return x.contiguous()


@op("linear_amx(Tensor x, Tensor packed, int out_features) -> Tensor")
def linear_amx(x, packed, out_features):
    """x: (rows, in) bf16 -> x w^T, (rows, out_features), for pack_amx's packed w (where amx_bf16())."""
    x = linear_args(x, packed, out_features, torch.bfloat16, "linear_amx")
    if x.shape[1] % 32:
        c.fail("packed", f"linear_amx needs a multiple of 32 inputs, has {x.shape[1]}")
    if not k.amx_bf16():
        raise RuntimeError("linear_amx: the CPU kernels were built without AMX (or the OS refused the tiles)")
    y = x.new_empty(x.shape[0], out_features)
    if x.shape[0]:
        k.lib_or_fail("linear_amx").linear_amx_bf16(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(),
                                                    out_features, y.data_ptr(), k.threads())
    return y


@op("pack_f32(Tensor w) -> Tensor")
def pack_f32(w):
    """w: (out, in) fp32, out a multiple of 16 -> the same values in linear_f32's layout, (out, in)."""
    c.tensor("w", w, 2, torch.float32)
    if w.shape[0] % 16 or w.shape[0] == 0:
        c.fail("w", f"linear_f32's layout needs a multiple of 16 outputs, has shape {tuple(w.shape)}")
    w = w.contiguous()
    out = torch.empty(w.shape, dtype=torch.float32)
    k.lib_or_fail("pack_f32").pack_f32_weights(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())
    return out


@op("linear_f32(Tensor x, Tensor packed, int out_features, Tensor? b) -> Tensor")
def linear_f32(x, packed, out_features, b=None):
    """x: (rows, in) fp32, pack_f32's w, b: (out,) or None -> x w^T + b, (rows, out_features); a row's values
    do not depend on the other rows."""
    x = linear_args(x, packed, out_features, torch.float32, "linear_f32")
    if b is not None:
        c.tensor("b", b, 1, torch.float32)
        c.shape("b", b, (out_features,))
        b = b.contiguous()
    if not k.f32_kernel():
        raise RuntimeError("linear_f32: the CPU kernels were built without AVX-512 or AVX2 with FMA")
    y = x.new_empty(x.shape[0], out_features)
    if x.shape[0]:
        k.lib_or_fail("linear_f32").linear_f32(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(),
                                               0 if b is None else b.data_ptr(), out_features, y.data_ptr(),
                                               k.threads())
    return y


# ---- a decode step's layers in one call ----
class LayerWeights(ctypes.Structure):     # cpu_kernels.cpp's LayerWeights, built per call from the tensors
    _fields_ = [(name, ctypes.c_void_p) for name in k.LAYER_WEIGHTS]


@op("decode_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
    "Tensor context_lens, Tensor[] input_norm, Tensor[] qkv, Tensor[] o, Tensor[] post_norm, Tensor[] gate_up, "
    "Tensor[] down, Tensor(b!)[] k_cache, Tensor(c!)[] v_cache, int heads, int kv_heads, float eps) -> Tensor")
def decode_layers(x, cos, sin, slot_mapping, block_tables, context_lens, input_norm, qkv, o, post_norm, gate_up,
                  down, k_cache, v_cache, heads, kv_heads, eps):
    """x: (rows, hidden), overwritten with the last layer's output; returns the residual stream. Per layer:
    the norms (hidden,), the linears packed for their kernel (AMX in bf16, linear_f32's in fp32) as (out, in),
    the caches (num_blocks, block_size, kv_heads, head_dim), one shape for all. Every tensor's shape is checked
    on every call; slots, block ids and context lengths once per call (the layers share them)."""
    c.tensor("x", x, 2, FLOAT)
    c.contiguous("x", x)
    rows, hidden = x.shape
    layers = len(qkv)
    for name, ts in zip(k.LAYER_WEIGHTS, (input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache)):
        if len(ts) != layers or not layers:
            c.fail(name, f"has {len(ts)} tensors for {layers} layers")
    nb, bs, kvh, d = cache_pair(k_cache[0], v_cache[0], x.dtype)
    if kvh != kv_heads:
        c.fail("kv_heads", f"{kv_heads}, but the caches hold {kvh}")
    c.divides("kv_heads", kv_heads, heads, "heads")
    inter = gate_up[0].shape[0] // 2 if gate_up[0].dim() == 2 else 0
    if not (hidden % 32 == 0 and heads * d % 32 == 0 and inter % 32 == 0 and inter > 0 and (bs, d) in k.SHAPES):
        c.fail("x", f"decode_layers has no kernel for hidden {hidden}, heads {heads} x {d}, inter {inter}, "
               f"block_size {bs} (multiples of 32; {sorted(k.SHAPES)})")
    if not (k.amx_bf16() if x.dtype == torch.bfloat16 else k.f32_kernel()):
        raise RuntimeError(f"decode_layers: this build has no {x.dtype} linears' kernel")
    want = {"input_norm": (hidden,), "post_norm": (hidden,), "qkv": ((heads + 2 * kv_heads) * d, hidden),
            "o": (hidden, heads * d), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "k_cache": (nb, bs, kvh, d), "v_cache": (nb, bs, kvh, d)}
    for name, ts in zip(k.LAYER_WEIGHTS, (input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache)):
        for i, t in enumerate(ts):
            if t.dtype != x.dtype or t.shape != want[name] or not t.is_contiguous() or t.device.type != "cpu":
                c.fail(f"{name}[{i}]", f"must be a contiguous {x.dtype} CPU tensor of shape {want[name]}, "
                       f"is {t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', strided'}")
    cos, sin = rope_table("cos", cos, rows, d, x.dtype), rope_table("sin", sin, rows, d, x.dtype)
    c.tensor("slot_mapping", slot_mapping, 1, torch.long)
    c.shape("slot_mapping", slot_mapping, (rows,))
    slots = slot_mapping.contiguous()
    c.ids("slot_mapping", slots, 0, nb * bs, "the cache's num_blocks * block_size slots")
    index_tables(rows, block_tables, context_lens, nb, bs)
    table = (LayerWeights * layers)(*(LayerWeights(*(t.data_ptr() for t in ts))
                                      for ts in zip(input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache)))
    residual = torch.empty_like(x)
    if rows and not k.function("decode_layers", f"decode_layers_{k.CHAINS[x.dtype]}")(
            ctypes.addressof(table), layers, x.data_ptr(), residual.data_ptr(), rows, hidden, heads, kv_heads, d,
            inter, bs, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), context_lens.data_ptr(), eps, d ** -0.5, k.threads()):
        raise RuntimeError("decode_layers: the library refused shapes these checks passed")
    return residual
