"""The CPU library (engine/kernels/cpu_kernels.cpp) loaded: its build (engine/kernels/build.py), the CPU's
features, and what each op needs of it. engine/kernels/ops.py, the checked ops the core calls, reads it.

Building, the child-process probe and the OpenMP runtime: engine/kernels/build.py. No compiler, a failed
build or a probe that died: `library()` is None and the engine takes the plain path."""
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
AMX_ROWS = 32       # up to this many rows the tile kernel computes oneDNN's tile values bit for bit (oneDNN
                    # sums in another order above it; tests/test_cpu_kernels.py) and streams weights faster
# decode_layers: one tensor of each per layer
LAYER_WEIGHTS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "k_cache", "v_cache")
F32_ROWS = 128      # a fp32 decode step of up to this many sequences runs its layers in one call (decode_layers)
EVERY_ROW = 1 << 62  # f32_kernel_rows where the kernel takes every row count
F32_AVX2_ROWS = 8   # without AVX-512 the fp32 linears' kernel holds 3 rows of sums, and oneDNN is faster from
                    # about a dozen rows on (docs/results.md): up to this many rows the kernel, then oneDNN
REFERENCES = {"paged_decode": reference.paged_decode, "write_kv": reference.write_kv,
              "causal_prefill": reference.causal_prefill, "rms_norm": reference.rms_norm,
              "add_rms_norm": reference.add_rms_norm, "silu_and_mul": reference.silu_and_mul,
              "rope": reference.apply_rope, "linear_amx": reference.linear_tiles, "linear_f32": reference.linear,
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
        why = build.ready(cxx, out)
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
        "has_avx512": ([], i32), "has_f32_linears": ([], i32), "causal_prefill_f32": (causal, i32),
        "causal_prefill_bf16": (causal, i32),
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


def f32_kernel() -> bool:
    """Whether the library has the fp32 linears' kernel (built with AVX-512, or AVX2 with FMA)."""
    lib = library()
    return lib is not None and bool(lib.has_f32_linears())


@functools.cache
def f32_linears() -> bool:
    """Whether a model's fp32 linears take that kernel; `BATCHSCOPE_F32_KERNEL=0` keeps oneDNN (or MKL)."""
    return os.environ.get("BATCHSCOPE_F32_KERNEL", "1") != "0" and f32_kernel()


def f32_kernel_rows() -> int:
    """Up to how many rows the fp32 kernel beats oneDNN: every row count with AVX-512, F32_AVX2_ROWS without."""
    return EVERY_ROW if avx512() else F32_AVX2_ROWS


def avx512() -> bool:
    lib = library()
    return lib is not None and bool(lib.has_avx512())


def amx_shape_ok(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 32 == 0


def threads() -> int:
    return torch.get_num_threads()


@functools.cache
def function(op: str, name: str):
    """The library's C function `name` with its argument types bound, looked up once; a RuntimeError naming
    `op` where the library did not build."""
    return getattr(lib_or_fail(op), name)


def lib_or_fail(op: str) -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"{op}: the CPU kernels are not built here (see the warning logged at start)")
    return lib
