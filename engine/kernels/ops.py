"""The CPU's own kernels (engine/kernels/cpu_kernels.cpp) as checked torch ops, `torch.ops.batchscope.*`.

The core calls one function per op below: the op's checked body itself, as a Python function.
torch.ops.batchscope.<name> is the same body behind torch's dispatcher (for torch.compile and callers that
want the schema); in eager CPU code the dispatcher only routes, at several microseconds a call, about a
millisecond of a decode step's ~200 op calls (docs/results.md). The schema says what an op writes
(`Tensor(a!)`); everything else it only reads. Each op's torch reference is in engine/kernels/reference.py
(`REFERENCES`), and `BATCHSCOPE_CPU_KERNEL=0` runs the references alone (the plain path). Each body checks
every shape, stride, dtype and index bound (the checks section below) before one ctypes call of the
library (engine/kernels/cpu_kernels.py loads it): bad input is a ValueError naming the argument, never a
write past a buffer.

  paged_decode   decode attention reading each sequence's blocks where they lie (engine/execution/backends.py
                 CpuAttention), no gather copy, no padding
  write_kv       a step's keys and values into their slots, in that kernel's layout inside a block
  causal_prefill fresh prompt chunks' causal attention, fp32 or bf16 (AVX-512); the core calls
                 causal_prefill_or_none, which says None where this build has no kernel for them
  rms_norm, add_rms_norm, silu_and_mul, rope
                 the model's elementwise chains (bf16, fp32) in one pass each (models.fast_paths.FusedOps)
  pack_amx, linear_amx
                 bf16 linears of 1 to 32 rows on AMX tiles, over weights laid out once for them
  pack_f32, linear_f32
                 fp32 linears on AVX-512 (every row count) or AVX2 with FMA (a decode step's few rows),
                 over weights laid out once for them
  decode_layers  a decode step's layers in one call of the kernels above, in the model's order, given the
                 layers' weights and caches as tensors; the core calls decode_step with the step's
                 AttentionMetadata and models.fast_paths.decode_weights
"""
from __future__ import annotations

import ctypes
import weakref

import torch
from torch.library import Library

from engine.kernels import cpu_kernels as k

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


# ---- checks: what every op checks before a pointer reaches C++ ----
# Each failure is a ValueError that names the argument and what it should be. Plain `if`s, never `assert`
# (python -O drops those).
#
# They run on every call, so they are written to cost well under a microsecond each: attribute reads and
# comparisons, no new tensors, no formatting until something fails (a decode step makes about 200 op
# calls; `python -m demos.bench.ops --only chains,kv_write` sets them beside torch at 1 row). Index bounds
# (slots, block ids, context lengths) cost a min and a max per index tensor; a step's metadata tensors are
# the same objects in all of its layers, so `check_ids` checks each tensor once per bound and remembers it
# (a weak reference and the tensor's version counter where it has one: inference tensors have none, and the
# runner builds its metadata once per step and never writes it). A new tensor, as a direct call passes, is
# always checked.
# id(tensor) -> (weak reference, version, low, high, data pointer, shape) of a passed check
_CHECKED: dict[int, tuple] = {}


def fail(name: str, problem: str):
    raise ValueError(f"{name}: {problem}")


def check_tensor(name: str, t, dims: int | None = None, dtype: torch.dtype | tuple | None = None) -> torch.Tensor:
    """A CPU tensor of `dims` dimensions and `dtype` (or one of them)."""
    if not isinstance(t, torch.Tensor):
        fail(name, f"expected a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        fail(name, f"must be on the CPU, is on {t.device}")
    if dims is not None and t.dim() != dims:
        fail(name, f"must have {dims} dimensions, has shape {tuple(t.shape)}")
    if dtype is not None and t.dtype is not dtype and (type(dtype) is not tuple or t.dtype not in dtype):
        fail(name, f"must be {dtype}, is {t.dtype}")
    return t


def check_shape(name: str, t: torch.Tensor, want: tuple):
    """t's shape is `want` (None: any size there)."""
    have = t.shape
    if have == want:
        return
    if len(have) != len(want) or any(w is not None and s != w for s, w in zip(have, want)):
        fail(name, f"must have shape {tuple('*' if w is None else w for w in want)}, has {tuple(t.shape)}")


def check_contiguous(name: str, t: torch.Tensor):
    if not t.is_contiguous():
        fail(name, f"must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def check_inner_rows(name: str, t: torch.Tensor):
    """(rows, heads, head_dim) whose rows may be strided but each row's heads lie packed."""
    (rows, heads, d), (s0, s1, s2) = t.shape, t.stride()
    if d > 1 and s2 != 1 or heads > 1 and s1 != d:
        fail(name, f"each row's heads must lie packed (strides {t.stride()} for shape {tuple(t.shape)})")
    if rows > 1 and s0 < heads * d:
        fail(name, f"rows overlap (strides {t.stride()} for shape {tuple(t.shape)})")


def check_divides(name: str, a: int, b: int, b_name: str):
    if a <= 0 or b % a:
        fail(name, f"{a} does not divide {b_name} ({b})")


def check_ids(name: str, t: torch.Tensor, low: int, high: int, what: str):
    """Every value of the int64 tensor t in [low, high); `what` says where high comes from."""
    version = None if t.is_inference() else t._version
    seen = _CHECKED.get(id(t))
    if seen is not None and seen[0]() is t and seen[1:] == (version, low, high, t.data_ptr(), t.shape):
        return
    if t.numel():
        lo, hi = (int(v) for v in torch.aminmax(t))
        if lo < low or hi >= high:
            fail(name, f"holds {lo if lo < low else hi}, outside [{low}, {high}) ({what})")
    if len(_CHECKED) > 256:
        _CHECKED.clear()
    _CHECKED[id(t)] = (weakref.ref(t), version, low, high, t.data_ptr(), t.shape)


# ---- attention over the paged cache ----
def cache_pair(k_cache, v_cache, dtype) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, kv_heads, head_dim) of two contiguous caches of one shape and `dtype`."""
    check_tensor("k_cache", k_cache, 4, dtype)
    check_contiguous("k_cache", k_cache)
    check_tensor("v_cache", v_cache, 4, dtype)
    check_contiguous("v_cache", v_cache)
    check_shape("v_cache", v_cache, k_cache.shape)
    return k_cache.shape


def index_tables(n: int, block_tables, context_lens, num_blocks: int, block_size: int):
    """block_tables (int64, (>= n, width), each row packed) names blocks of the cache, and context_lens
    (int64, (>= n,), contiguous) fit their rows: 1 .. width * block_size tokens."""
    check_tensor("block_tables", block_tables, 2, torch.long)
    check_tensor("context_lens", context_lens, 1, torch.long)
    check_contiguous("context_lens", context_lens)
    (tables, width), lens = block_tables.shape, context_lens.shape[0]
    if tables < n or lens < n:
        fail("block_tables" if tables < n else "context_lens", f"has {min(tables, lens)} rows for {n} sequences")
    if width > 1 and block_tables.stride(1) != 1:
        fail("block_tables", f"each row must be packed (strides {block_tables.stride()})")
    # the whole tensors (the runner's rows beyond the decodes are valid too): the same objects in every layer
    check_ids("block_tables", block_tables, 0, num_blocks, "the cache's num_blocks")
    check_ids("context_lens", context_lens, 1, width * block_size + 1,
              "a row of the table holds its width * block_size tokens, and at least one")


@op("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens) -> Tensor")
def paged_decode(q, k_cache, v_cache, block_tables, context_lens):
    """q: (n, heads, head_dim), rows may be strided; caches: (num_blocks, block_size, kv_heads, head_dim) in
    the kernel's layout; block_tables: (>= n, width) int64; context_lens: (>= n,) int64 -> (n, heads, head_dim).
    Block ids and context lengths are checked against the cache (a min and a max each), once per tensor
    and bound (check_ids): a step's layers share them."""
    check_tensor("q", q, 3, FLOAT)
    nb, bs, kvh, d = cache_pair(k_cache, v_cache, q.dtype)
    n, heads, q_d = q.shape
    if q_d != d:
        fail("q", f"must have shape (*, *, {d}), has {tuple(q.shape)}")
    check_inner_rows("q", q)
    check_divides("kv_heads", kvh, heads, "q's heads")
    if (bs, d) not in k.SHAPES:
        fail("k_cache", f"paged_decode has no kernel for block_size {bs} and head_dim {d} ({sorted(k.SHAPES)})")
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
    block layout. Slots are checked against the cache's num_blocks * block_size, once per tensor (check_ids)."""
    check_tensor("k", key, 3, FLOAT)
    nb, bs, kvh, d = cache_pair(k_cache, v_cache, key.dtype)
    check_tensor("v", value, 3, key.dtype)
    for name, t in (("k", key), ("v", value)):
        check_shape(name, t, (None, kvh, d))
        check_inner_rows(name, t)
    check_shape("v", value, key.shape)
    check_tensor("slot_mapping", slot_mapping, 1, torch.long)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    slots = slot_mapping.contiguous()
    check_ids("slot_mapping", slots, 0, nb * bs, "the cache's num_blocks * block_size slots")
    if key.shape[0]:
        k.function("write_kv", "write_kv_16" if key.element_size() == 2 else "write_kv_32")(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), key.shape[0], kvh, d, bs, k.threads())


@op("causal_prefill(Tensor q, Tensor k, Tensor v, int m) -> Tensor")
def causal_prefill(q, key, value, m):
    """m fresh prompt chunks of one length side by side: q (m * q_len, heads, head_dim), k and v (m * q_len,
    kv_heads, head_dim), fp32 or bf16 (computed in fp32), rows may be strided -> (m * q_len, heads, head_dim)."""
    check_tensor("q", q, 3, FLOAT)
    rows, heads, d = q.shape
    check_tensor("k", key, 3, q.dtype)
    check_tensor("v", value, 3, q.dtype)
    kvh = key.shape[1]
    for name, t in (("q", q), ("k", key), ("v", value)):
        check_shape(name, t, (rows, heads if name == "q" else kvh, d))
        check_inner_rows(name, t)
    check_divides("kv_heads", kvh, heads, "q's heads")
    if m <= 0 or rows % m:
        fail("m", f"{m} chunks do not split {rows} rows evenly")
    if d not in (64, 128) or not k.avx512():
        fail("q", f"causal_prefill has no kernel for head_dim {d} in this build (64 and 128, on AVX-512)")
    out = q.new_empty(rows, heads, d)
    if rows:
        k.function("causal_prefill", CAUSAL[q.dtype])(
            q.data_ptr(), q.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            out.data_ptr(), m, rows // m, heads, kvh, d, d ** -0.5, k.threads())
    return out


# ---- elementwise chains ----
def rows_of(name: str, x, weight) -> torch.Tensor:
    """x as contiguous (rows, hidden): itself where it already is (the hidden states), else a copy."""
    check_tensor(name, x, None, FLOAT)
    if x.dim() < 1 or x.shape[-1] == 0:
        fail(name, f"needs a last dimension to normalise over, has shape {tuple(x.shape)}")
    check_tensor("weight", weight, 1, x.dtype)
    check_shape("weight", weight, (x.shape[-1],))
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
    check_tensor("residual", residual, None, x.dtype)
    check_shape("residual", residual, x.shape)
    res = residual if residual.dim() == 2 and residual.is_contiguous() else residual.reshape(flat.shape).contiguous()
    out, total = torch.empty_like(flat), torch.empty_like(flat)
    norm_call(flat, res, weight, eps, out, total)
    return like(out, x), like(total, x)


@op("silu_and_mul(Tensor gate_up, int inter) -> Tensor")
def silu_and_mul(gate_up, inter):
    """(rows, 2 * inter) = [gate | up] -> silu(gate) * up, (rows, inter)."""
    check_tensor("gate_up", gate_up, 2, FLOAT)
    if inter <= 0 or gate_up.shape[1] != 2 * inter:
        fail("inter", f"{inter} is not half of gate_up's width {gate_up.shape[1]}")
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], inter)
    if gate_up.shape[0]:
        k.function("silu_and_mul", SILU[gate_up.dtype])(
            gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, k.threads())
    return out


def rope_table(name: str, t, rows: int, d: int, dtype) -> torch.Tensor:
    """cos or sin: (rows, 1, head_dim) or (rows, head_dim), one row per position of x."""
    check_tensor(name, t, None, dtype)
    if t.dim() not in (2, 3) or t.shape[0] != rows or t.shape[-1] != d or t.numel() != rows * d:
        fail(name, f"must have one row of {d} per position ({rows}, 1, {d}), has shape {tuple(t.shape)}")
    return t.contiguous()


@op("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")
def rope(x, cos, sin):
    """x: (rows, heads, head_dim), rows may be strided; cos, sin: (rows, 1, head_dim) -> a new contiguous x."""
    check_tensor("x", x, 3, FLOAT)
    rows, heads, d = x.shape
    if d % 2:
        fail("x", f"head_dim {d} must be even (RoPE rotates its halves)")
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
    check_tensor("w", w, 2, torch.bfloat16)
    if not k.amx_shape_ok(*w.shape):
        fail("w", f"the tile layout needs out a multiple of 16 and in of 32, has shape {tuple(w.shape)}")
    w = w.contiguous()
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    k.lib_or_fail("pack_amx").pack_amx_bf16(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())
    return out


def linear_args(x, packed, out_features, dtype, name: str):
    check_tensor("x", x, 2, dtype)
    check_tensor("packed", packed, 2, dtype)
    check_contiguous("packed", packed)
    if packed.shape[0] != out_features:
        fail("out_features", f"{out_features}, but the packed weight has {packed.shape[0]} outputs")
    if packed.shape[1] != x.shape[1]:
        fail("x", f"has {x.shape[1]} features, the packed weight takes {packed.shape[1]}")
    if out_features % 16 or out_features == 0:
        fail("packed", f"{name} needs a multiple of 16 outputs, has {out_features}")
    return x.contiguous()


@op("linear_amx(Tensor x, Tensor packed, int out_features) -> Tensor")
def linear_amx(x, packed, out_features):
    """x: (rows, in) bf16 -> x w^T, (rows, out_features), for pack_amx's packed w (where amx_bf16())."""
    x = linear_args(x, packed, out_features, torch.bfloat16, "linear_amx")
    if x.shape[1] % 32:
        fail("packed", f"linear_amx needs a multiple of 32 inputs, has {x.shape[1]}")
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
    check_tensor("w", w, 2, torch.float32)
    if w.shape[0] % 16 or w.shape[0] == 0:
        fail("w", f"linear_f32's layout needs a multiple of 16 outputs, has shape {tuple(w.shape)}")
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
        check_tensor("b", b, 1, torch.float32)
        check_shape("b", b, (out_features,))
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
    check_tensor("x", x, 2, FLOAT)
    check_contiguous("x", x)
    rows, hidden = x.shape
    layers = len(qkv)
    for name, ts in zip(k.LAYER_WEIGHTS, (input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache)):
        if len(ts) != layers or not layers:
            fail(name, f"has {len(ts)} tensors for {layers} layers")
    nb, bs, kvh, d = cache_pair(k_cache[0], v_cache[0], x.dtype)
    if kvh != kv_heads:
        fail("kv_heads", f"{kv_heads}, but the caches hold {kvh}")
    check_divides("kv_heads", kv_heads, heads, "heads")
    inter = gate_up[0].shape[0] // 2 if gate_up[0].dim() == 2 else 0
    if not (hidden % 32 == 0 and heads * d % 32 == 0 and inter % 32 == 0 and inter > 0 and (bs, d) in k.SHAPES):
        fail("x", f"decode_layers has no kernel for hidden {hidden}, heads {heads} x {d}, inter {inter}, "
             f"block_size {bs} (multiples of 32; {sorted(k.SHAPES)})")
    if not (k.amx_bf16() if x.dtype == torch.bfloat16 else k.f32_kernel()):
        raise RuntimeError(f"decode_layers: this build has no {x.dtype} linears' kernel")
    want = {"input_norm": (hidden,), "post_norm": (hidden,), "qkv": ((heads + 2 * kv_heads) * d, hidden),
            "o": (hidden, heads * d), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "k_cache": (nb, bs, kvh, d), "v_cache": (nb, bs, kvh, d)}
    for name, ts in zip(k.LAYER_WEIGHTS, (input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache)):
        for i, t in enumerate(ts):
            if t.dtype != x.dtype or t.shape != want[name] or not t.is_contiguous() or t.device.type != "cpu":
                fail(f"{name}[{i}]", f"must be a contiguous {x.dtype} CPU tensor of shape {want[name]}, "
                     f"is {t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', strided'}")
    cos, sin = rope_table("cos", cos, rows, d, x.dtype), rope_table("sin", sin, rows, d, x.dtype)
    check_tensor("slot_mapping", slot_mapping, 1, torch.long)
    check_shape("slot_mapping", slot_mapping, (rows,))
    slots = slot_mapping.contiguous()
    check_ids("slot_mapping", slots, 0, nb * bs, "the cache's num_blocks * block_size slots")
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


# ---- the calls the core makes where the op alone is not enough ----
def causal_prefill_or_none(q, key, value, m: int) -> torch.Tensor | None:
    """Their causal attention, or None where this build has no kernel for them (no AVX-512, a dtype or
    head_dim without one, rows whose heads are not packed): the caller runs SDPA then."""
    d = q.shape[-1]
    if (q.dtype not in k.CHAINS or not k.avx512() or d not in (64, 128)
            or any(t.dim() != 3 or t.stride()[1:] != (d, 1) for t in (q, key, value))):
        return None
    return causal_prefill(q, key, value, m)


def decode_step(x, cos, sin, meta, weights: dict, *, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """A decode-only step's layers over x, the step's embeddings (rows, hidden), bf16 or fp32, which it
    overwrites with the last layer's output; returns the residual stream. meta: the step's AttentionMetadata;
    weights: LAYER_WEIGHTS -> one tensor per layer (the linears in their kernel's layout)."""
    return decode_layers(x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
                         *(weights[name] for name in k.LAYER_WEIGHTS), heads, kv_heads, eps)
