"""The CPU's own kernels (engine/kernels/cpu_kernels.cpp) as checked torch ops, `torch.ops.batchscope.*`.

The core calls one function per op below; its torch reference is beside it in engine/kernels/reference.py
(`REFERENCES`), and `BATCHSCOPE_CPU_KERNEL=0` runs the references alone (the plain path). Each op checks
every shape, stride, dtype and index bound before a pointer reaches C++ (engine/kernels/checks.py): bad
input is a ValueError naming the argument, never a write past a buffer.

  paged_decode   decode attention reading each sequence's blocks where they lie (engine/execution/attention.py
                 CpuAttention), no gather copy, no padding
  write_kv       a step's keys and values into their slots, in that kernel's layout inside a block
  causal_prefill fresh prompt chunks' causal attention, fp32 or bf16 (AVX-512)
  rms_norm, add_rms_norm, silu_and_mul, rope
                 the model's elementwise chains (bf16, fp32) in one pass each (models.llama.FusedOps)
  pack_amx, linear_amx
                 bf16 linears of 1 to 32 rows on AMX tiles, over weights laid out once for them
  pack_f32, linear_f32
                 fp32 linears on AVX-512, over weights laid out once for them
  decode_layers  a decode step's layers in one call of the kernels above, in the model's order, given the
                 layers' weights and caches as tensors (models.llama.LlamaForCausalLM.decode_weights)

Building, the child-process probe and the OpenMP runtime: engine/kernels/build.py. No compiler, a failed
build or a probe that died: `library()` is None and the engine takes the plain path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import shutil

import torch

from engine.config import cache_dir
from engine.kernels import build, reference

log = logging.getLogger("batchscope.engine")

FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
CHAINS = {torch.bfloat16: "bf16", torch.float32: "f32"}    # the suffix of the chains' and causal kernel's builds
SHAPES = {(16, 64), (16, 128), (32, 64), (32, 128)}   # (block_size, head_dim) compiled in cpu_kernels.cpp
AMX_ROWS = 32       # up to this many rows the tile kernel computes F.linear's values bit for bit (oneDNN
                    # sums in another order above it; tests/test_cpu_kernels.py) and streams weights faster
F32_ROWS = 128      # a fp32 decode step of up to this many sequences runs its layers in one call (decode_layers)
REFERENCES = {"paged_decode": reference.paged_decode, "write_kv": reference.write_kv,
              "causal_prefill": reference.causal_prefill, "rms_norm": reference.rms_norm,
              "add_rms_norm": reference.add_rms_norm, "silu_and_mul": reference.silu_and_mul,
              "rope": reference.apply_rope, "linear_amx": reference.linear, "linear_f32": reference.linear,
              "decode_layers": reference.decode_layers}


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    return platform.processor() + platform.machine()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built, probed library, or None (switched off, no compiler, a failed build, a probe that died).
    BATCHSCOPE_CPU_KERNEL_PATH loads a given build as it is (the probe's child, the AddressSanitizer run)."""
    if os.environ.get("BATCHSCOPE_CPU_KERNEL", "1") == "0":
        return None
    if os.environ.get("BATCHSCOPE_CPU_KERNEL_PATH"):
        return bind(ctypes.CDLL(os.environ["BATCHSCOPE_CPU_KERNEL_PATH"]))
    cxx = compiler()
    if cxx is None:
        log.info("no C++ compiler found: CPU attention and elementwise ops run torch's")
        return None
    try:
        out = build.library_path(cxx, cpu_flags(), cache_dir())
        if not out.exists():
            build.build(cxx, out)
        why = build.probe(out)
        if why is None:
            return bind(ctypes.CDLL(str(out)))
    except Exception as e:     # a broken compiler must not stop the engine: the plain path serves
        why = f"they did not build ({e})"
    log.warning("the CPU kernels are off (%s): attention and elementwise ops run torch's", why)
    return None


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The C functions' argument types (ctypes converts each Python int to its C type)."""
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    decode = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32, f32, i32]
    norm, silu, rope_ = [ptr, ptr, ptr, ptr, ptr, i64, i32, f32, i32], [ptr, ptr, i64, i32, i32], \
        [ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32]
    kv = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32]
    causal = [ptr, i64, ptr, i64, ptr, i64, ptr, i32, i32, i32, i32, i32, f32, i32]
    layers = [ptr, i32, ptr, ptr, i64, i32, i32, i32, i32, i32, i32, ptr, ptr, ptr, ptr, i64, ptr, f32, f32, i32]
    signatures = {
        "paged_decode_f32": (decode, i32), "paged_decode_bf16": (decode, i32),
        "rms_norm_bf16": (norm, None), "rms_norm_f32": (norm, None), "silu_and_mul_bf16": (silu, None),
        "silu_and_mul_f32": (silu, None), "rope_bf16": (rope_, None), "rope_f32": (rope_, None),
        "write_kv_16": (kv, None), "write_kv_32": (kv, None),
        "pack_amx_bf16": ([ptr, i64, i64, ptr], None), "pack_f32_weights": ([ptr, i64, i64, ptr], None),
        "linear_amx_bf16": ([ptr, i64, i64, ptr, i64, ptr, i32], i32),
        "linear_f32": ([ptr, i64, i64, ptr, ptr, i64, ptr, i32], i32), "amx_bf16_ready": ([], i32),
        "has_avx512": ([], i32), "causal_prefill_f32": (causal, i32), "causal_prefill_bf16": (causal, i32),
        "decode_layers_bf16": (layers, i32), "decode_layers_f32": (layers, i32)}
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def supports(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    return dtype in FUNCTIONS and (block_size, head_dim) in SHAPES and library() is not None


def fused_chains() -> bool:
    return library() is not None


@functools.cache
def amx_bf16() -> bool:
    """Whether the library was built with AMX (the CPU has amx_bf16) and the OS lets this process use it."""
    lib = library()
    return lib is not None and os.environ.get("BATCHSCOPE_AMX", "1") != "0" and bool(lib.amx_bf16_ready())


@functools.cache
def f32_linears() -> bool:
    """Whether the library was built with AVX-512, which the fp32 kernel needs; `BATCHSCOPE_F32_KERNEL=0` keeps MKL."""
    lib = library()
    return lib is not None and os.environ.get("BATCHSCOPE_F32_KERNEL", "1") != "0" and bool(lib.has_avx512())


def avx512() -> bool:
    lib = library()
    return lib is not None and bool(lib.has_avx512())


def amx_shape_ok(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 32 == 0


def threads() -> int:
    return torch.get_num_threads()


def lib_or_fail(op: str) -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"{op}: the CPU kernels are not built here (see the warning logged at start)")
    return lib


# ---- the ops the core calls (their checked bodies: engine/kernels/ops.py) ----
def paged_decode(q, k_cache, v_cache, block_tables, context_lens) -> torch.Tensor:
    return torch.ops.batchscope.paged_decode(q, k_cache, v_cache, block_tables, context_lens)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    torch.ops.batchscope.write_kv(k, v, k_cache, v_cache, slot_mapping)


def causal_prefill(q, k, v, m: int) -> torch.Tensor | None:
    """Their causal attention, or None where this build has no kernel for them (no AVX-512, a dtype or
    head_dim without one, rows whose heads are not packed): the caller runs SDPA then."""
    d = q.shape[-1]
    if (q.dtype not in CHAINS or not avx512() or d not in (64, 128)
            or any(t.dim() != 3 or t.stride()[1:] != (d, 1) for t in (q, k, v))):
        return None
    return torch.ops.batchscope.causal_prefill(q, k, v, m)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    return torch.ops.batchscope.rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps: float):
    return torch.ops.batchscope.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up, inter: int) -> torch.Tensor:
    return torch.ops.batchscope.silu_and_mul(gate_up, inter)


def rope(x, cos, sin) -> torch.Tensor:
    return torch.ops.batchscope.rope(x, cos, sin)


def pack_amx(w) -> torch.Tensor:
    return torch.ops.batchscope.pack_amx(w)


def linear_amx(x, packed, out_features: int) -> torch.Tensor:
    return torch.ops.batchscope.linear_amx(x, packed, out_features)


def pack_f32(w) -> torch.Tensor:
    return torch.ops.batchscope.pack_f32(w)


def linear_f32(x, packed, out_features: int, b=None) -> torch.Tensor:
    return torch.ops.batchscope.linear_f32(x, packed, out_features, b)


LAYER_WEIGHTS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "k_cache", "v_cache")


def decode_layers(x, cos, sin, meta, weights: dict, *, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """A decode-only step's layers over x, the step's embeddings (rows, hidden), bf16 or fp32, which it
    overwrites with the last layer's output; returns the residual stream. meta: the step's AttentionMetadata;
    weights: LAYER_WEIGHTS -> one tensor per layer (the linears in their kernel's layout)."""
    return torch.ops.batchscope.decode_layers(x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
                                              *(weights[k] for k in LAYER_WEIGHTS), heads, kv_heads, eps)


from engine.kernels import ops  # noqa: E402,F401  (registers torch.ops.batchscope.*)
