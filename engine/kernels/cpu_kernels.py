"""The CPU's own kernels (engine/kernels/cpu_kernels.cpp), built once per machine and loaded with ctypes.

  causal_prefill fresh prompt chunks' causal attention in fp32 (CpuAttention.causal): 2-4x less time than SDPA.
  paged_decode   decode attention. The portable path gathers every decode's K/V blocks into a padded
                 copy and runs SDPA over it: each layer writes the context once more and reads it
                 twice. The kernel reads the cache where it lies (engine/attention.CpuAttention).
  rms_norm, silu_and_mul, rope
                 the model's elementwise chains (bf16, fp32) in one pass each (models.llama.FusedOps):
                 torch runs them op by op, 2 to 9 passes over memory, and a 2,048-token bf16 prefill
                 step spent a quarter of its time there.
  decode_layers  a decode step's layers in one call, the kernels above in the model's order (models.llama):
                 the same values without the Python between them.
  linear_amx     bf16 linears of 1 to 32 rows (a decode step) on AMX tiles, over weights laid out once
                 for them (models.linears.Linear): they stream the weights 1.3-1.5x faster than oneDNN.
  linear_f32     fp32 linears on AVX-512, over weights laid out once for them: 2.2-2.9x less time than
                 MKL, as fast as oneDNN at 2,048 rows and faster below (docs/results.md).

The library is built with the system's C++ compiler (g++, c++ or clang++; $CXX first) for this CPU
(-march=native) in about a second, into the batchscope cache under a name that hashes the source,
the flags, the compiler and the CPU's feature flags, so a cache folder shared by machines with other
CPUs never loads code built for another. No compiler, or a failed build: `library()` is None and
attention stays on the portable path (engine/attention.select_backend).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.config import cache_dir

log = logging.getLogger("batchscope.engine")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -ffast-math lets the compiler vectorise exp (glibc's libmvec) and the reductions; it is given only
# when compiling, not when linking, so the library does not switch the process to flush-to-zero
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17"]
LINK = ["-shared", "-fopenmp"]      # libgomp.so.1: the OpenMP runtime torch has loaded, so its threads
FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
CHAINS = {torch.bfloat16: "bf16", torch.float32: "f32"}    # the suffix of the chains' and causal kernel's builds
SHAPES = {(16, 64), (16, 128), (32, 64), (32, 128)}   # (block_size, head_dim) compiled in cpu_kernels.cpp


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (no compiler, not Linux/x86 or ARM with OpenMP, a failed build)."""
    if os.environ.get("BATCHSCOPE_CPU_KERNEL", "1") == "0":
        return None
    cxx = compiler()
    if cxx is None:
        log.info("no C++ compiler found: CPU attention and elementwise ops run torch's")
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), *COMPILE, *LINK, version, cpu_flags()]).encode())
        out = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
        if not out.exists():
            build(cxx, out)
        lib = ctypes.CDLL(str(out))
    except Exception as e:     # a broken compiler must not stop the engine: the portable path serves
        log.warning("the CPU kernels did not build (%s): attention and elementwise ops run torch's", e)
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    for name in FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]
        fn.restype = ctypes.c_int
    i64p = [ptr, ptr, ptr, ptr, ptr, i64, i32, ctypes.c_float, i32]
    for name, args in {"rms_norm_bf16": i64p, "silu_and_mul_bf16": [ptr, ptr, i64, i32, i32],
                       "rope_bf16": [ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32],
                       "rms_norm_f32": i64p, "silu_and_mul_f32": [ptr, ptr, i64, i32, i32],
                       "rope_f32": [ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32],
                       "write_kv_16": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32],
                       "write_kv_32": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32],
                       "pack_amx_bf16": [ptr, i64, i64, ptr], "pack_f32_weights": [ptr, i64, i64, ptr]}.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    lib.linear_amx_bf16.argtypes, lib.linear_amx_bf16.restype = [ptr, i64, i64, ptr, i64, ptr, i32], ctypes.c_int
    lib.linear_f32.argtypes, lib.linear_f32.restype = [ptr, i64, i64, ptr, ptr, i64, ptr, i32], ctypes.c_int
    lib.amx_bf16_ready.argtypes, lib.amx_bf16_ready.restype = [], ctypes.c_int
    for name in ("causal_prefill_f32", "causal_prefill_bf16"):
        getattr(lib, name).argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]
        getattr(lib, name).restype = ctypes.c_int
    for name in ("decode_layers_bf16", "decode_layers_f32"):
        getattr(lib, name).argtypes = [ptr, i32, ptr, ptr, i64, i32, i32, i32, i32, i32, i32, ptr, ptr, ptr, ptr, i64,
                                       ptr, ctypes.c_float, ctypes.c_float, i32]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def build(cxx: str, out: Path):
    """Compile, then link, into a temporary name beside `out`, then rename: processes building at once
    (a test run's servers) each finish their own file and the last rename wins, whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "cpu_kernels.o", Path(tmp) / out.name
        for cmd in ([cxx, *COMPILE, "-c", str(SOURCE), "-o", str(obj)], [cxx, *LINK, str(obj), "-o", str(lib)]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(f"{' '.join(cmd[:2])} ... exited {r.returncode}: {r.stderr.strip()[-500:]}")
        os.replace(lib, out)


def supports(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    return dtype in FUNCTIONS and (block_size, head_dim) in SHAPES and library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
    """q: (n, heads, head_dim), rows may be strided; caches: (num_blocks, block_size, kv_heads, head_dim);
    block_tables: (>= n, max_blocks) long; context_lens: (>= n,) long -> (n, heads, head_dim)."""
    n, heads, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.long and context_lens.dtype == torch.long and block_tables.stride(1) == 1
    assert context_lens.is_contiguous()
    out = torch.empty(n, heads, d, dtype=q.dtype)
    done = getattr(library(), FUNCTIONS[q.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), n, heads, k_cache.shape[2], d,
        k_cache.shape[1], d ** -0.5, torch.get_num_threads())
    if not done:
        raise ValueError(f"paged_decode has no kernel for block_size {k_cache.shape[1]} and head_dim {d}")
    return out


def causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: int) -> torch.Tensor | None:
    """m fresh prompt chunks of one length side by side: q (m * q_len, heads, head_dim), k and v (m * q_len,
    kv_heads, head_dim), fp32 or bf16 (computed in fp32), rows may be strided -> their causal attention,
    (m * q_len, heads, head_dim); None where this build has no kernel for them (no AVX-512, another head_dim)."""
    rows, heads, d = q.shape
    if q.dtype not in CHAINS or library() is None or any(t.stride()[1:] != (d, 1) for t in (q, k, v)):
        return None
    out = q.new_empty(rows, heads, d)
    if not getattr(library(), f"causal_prefill_{CHAINS[q.dtype]}")(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(), m,
            rows // m, heads, k.shape[1], d, d ** -0.5, torch.get_num_threads()):
        return None
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor):
    """k, v: (tokens, kv_heads, head_dim), rows may be strided -> their slots, in paged_decode's block layout."""
    _, kvh, d = k.shape
    assert k.stride()[1:] == (d, 1) and v.stride()[1:] == (d, 1) and slot_mapping.dtype == torch.long
    assert k.dtype == v.dtype == k_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
    fn = {2: "write_kv_16", 4: "write_kv_32"}[k.element_size()]
    getattr(library(), fn)(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), slot_mapping.contiguous().data_ptr(), k.shape[0], kvh, d,
                           k_cache.shape[1], torch.get_num_threads())


# ---- elementwise chains: the same values as models.llama's torch versions (tests/test_cpu_kernels.py) ----


def fused_chains() -> bool:
    return library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norm(x), or with residual (norm(x + residual), x + residual), over the last dim; bf16 or fp32."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()           # a view where it already is (the hidden states)
    if residual is not None:
        residual = residual.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    getattr(library(), f"rms_norm_{CHAINS[x.dtype]}")(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        0 if total is None else total.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out.view(shape) if total is None else (out.view(shape), total.view(shape))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return rms_norm(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """(rows, 2 * inter) = [gate | up], contiguous -> silu(gate) * up, (rows, inter)."""
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], inter)
    getattr(library(), f"silu_and_mul_{CHAINS[gate_up.dtype]}")(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0],
                                                               inter, torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (rows, heads, head_dim), rows may be strided; cos, sin: (rows, 1, head_dim) -> a new contiguous x."""
    rows, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = x.new_empty(rows, heads, d)
    getattr(library(), f"rope_{CHAINS[x.dtype]}")(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                                                  out.data_ptr(), rows, heads, d, torch.get_num_threads())
    return out


# ---- bf16 linears on AMX tiles ----
AMX_ROWS = 32       # up to this many rows the tile kernel computes F.linear's values bit for bit (oneDNN
                    # sums in another order above it; tests/test_cpu_kernels.py) and streams weights faster


@functools.cache
def amx_bf16() -> bool:
    """Whether the library was built with AMX (the CPU has amx_bf16) and the OS lets this process use it."""
    lib = library()
    return lib is not None and os.environ.get("BATCHSCOPE_AMX", "1") != "0" and bool(lib.amx_bf16_ready())


def amx_shape_ok(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 32 == 0


def pack_amx(w: torch.Tensor) -> torch.Tensor:
    """w: (out, in) bf16, out a multiple of 16 and in of 32 -> the same values in the tile layout (flat)."""
    assert w.dtype == torch.bfloat16 and amx_shape_ok(*w.shape), (w.dtype, tuple(w.shape))
    w = w.contiguous()
    out = torch.empty(w.numel(), dtype=torch.bfloat16)
    library().pack_amx_bf16(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())
    return out


def linear_amx(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x: (rows, in) bf16 -> x w^T, (rows, out_features), for pack_amx's packed w (made where amx_bf16(),
    which also asked the OS for the tiles)."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], out_features)
    if not library().linear_amx_bf16(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), out_features,
                                     y.data_ptr(), torch.get_num_threads()):
        raise RuntimeError("the CPU kernels were built without AMX")
    return y


# ---- fp32 linears of a decode step's few rows (AVX-512) ----
F32_ROWS = 128      # a fp32 decode step of up to this many sequences runs its layers in one call (decode_layers)


@functools.cache
def f32_linears() -> bool:
    """Whether the library was built with AVX-512, which the fp32 kernel needs; `BATCHSCOPE_F32_KERNEL=0` keeps MKL."""
    lib = library()
    if lib is None or os.environ.get("BATCHSCOPE_F32_KERNEL", "1") == "0":
        return False
    x, w, y = torch.ones(1, 16), torch.ones(16 * 16), torch.empty(1, 16)
    return bool(lib.linear_f32(x.data_ptr(), 1, 16, w.data_ptr(), 0, 16, y.data_ptr(), 1))


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """w: (out, in) fp32, out a multiple of 16 -> the same values in linear_f32's layout (flat)."""
    assert w.dtype == torch.float32 and w.shape[0] % 16 == 0, (w.dtype, tuple(w.shape))
    w = w.contiguous()
    out = torch.empty(w.numel(), dtype=torch.float32)
    library().pack_f32_weights(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())
    return out


def linear_f32(x: torch.Tensor, packed: torch.Tensor, out_features: int, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: (rows, in) fp32, pack_f32's w, b: (out,) or None -> x w^T + b, (rows, out_features); a row's
    values do not depend on the other rows (made where f32_linears())."""
    x, b = x.contiguous(), None if b is None else b.contiguous()
    y = x.new_empty(x.shape[0], out_features)
    library().linear_f32(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), 0 if b is None else b.data_ptr(),
                         out_features, y.data_ptr(), torch.get_num_threads())
    return y


def decode_layers(table: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, *, heads: int,
                  kv_heads: int, head_dim: int, inter: int, block_size: int, eps: float) -> torch.Tensor:
    """A decode-only step's layers (models.llama.LlamaForCausalLM.layer_table's weights and caches) over x, the
    step's embeddings (rows, hidden), bf16 or fp32, which it overwrites with the last layer's output; returns
    the residual stream. meta: the step's AttentionMetadata (slots, block tables, context lengths)."""
    assert x.dtype in CHAINS and x.is_contiguous() and table.dtype == torch.int64 and table.is_contiguous()
    tables, lens, slots = meta.block_tables, meta.context_lens.contiguous(), meta.slot_mapping.contiguous()
    assert tables.dtype == lens.dtype == slots.dtype == torch.long and tables.stride(1) == 1
    cos, sin = cos.contiguous(), sin.contiguous()
    residual = torch.empty_like(x)
    if not getattr(library(), f"decode_layers_{CHAINS[x.dtype]}")(
            table.data_ptr(), table.shape[0], x.data_ptr(), residual.data_ptr(), x.shape[0], x.shape[1], heads,
            kv_heads, head_dim, inter, block_size, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            tables.stride(0), lens.data_ptr(), eps, head_dim ** -0.5, torch.get_num_threads()):
        raise ValueError("decode_layers has no kernel for these shapes (or this build has not the linears' kernel)")
    return residual
