"""The CPU's own kernels (engine/kernels/cpu_kernels.cpp) as checked torch ops, `torch.ops.batchscope.*`.

The core calls one function per op below: the op's checked body itself (engine/kernels/ops.py), as a Python
function. torch.ops.batchscope.<name> is the same body behind torch's dispatcher (for torch.compile and
callers that want the schema); in eager CPU code the dispatcher only routes, at several microseconds a
call, about a millisecond of a decode step's ~200 op calls (docs/results.md). Each op's torch reference
is beside it in engine/kernels/reference.py
(`REFERENCES`), and `BATCHSCOPE_CPU_KERNEL=0` runs the references alone (the plain path). Each op checks
every shape, stride, dtype and index bound before a pointer reaches C++ (engine/kernels/checks.py): bad
input is a ValueError naming the argument, never a write past a buffer.

  paged_decode   decode attention reading each sequence's blocks where they lie (engine/execution/attention.py
                 CpuAttention), no gather copy, no padding
  write_kv       a step's keys and values into their slots, in that kernel's layout inside a block
  causal_prefill fresh prompt chunks' causal attention, fp32 or bf16 (AVX-512)
  rms_norm, add_rms_norm, silu_and_mul, rope
                 the model's elementwise chains (bf16, fp32) in one pass each (models.fast_paths.FusedOps)
  pack_amx, linear_amx
                 bf16 linears of 1 to 32 rows on AMX tiles, over weights laid out once for them
  pack_f32, linear_f32
                 fp32 linears on AVX-512 (every row count) or AVX2 with FMA (a decode step's few rows),
                 over weights laid out once for them
  decode_layers  a decode step's layers in one call of the kernels above, in the model's order, given the
                 layers' weights and caches as tensors (models.fast_paths.decode_weights)

Building, the child-process probe and the OpenMP runtime: engine/kernels/build.py. No compiler, a failed
build or a probe that died: `library()` is None and the engine takes the plain path.
"""
from __future__ import annotations

import torch

from engine.kernels import ops
from engine.kernels.loading import (  # noqa: F401  (the interface the core calls reads them here)
    AMX_ROWS,
    CHAINS,
    EVERY_ROW,
    F32_AVX2_ROWS,
    F32_ROWS,
    FUNCTIONS,
    LAYER_WEIGHTS,
    REFERENCES,
    SHAPES,
    amx_bf16,
    amx_shape_ok,
    avx512,
    bind,
    compiler,
    cpu_flags,
    f32_kernel,
    f32_kernel_rows,
    f32_linears,
    fused_chains,
    lib_or_fail,
    library,
    supports,
    threads,
)
from engine.kernels.ops import (  # noqa: F401
    add_rms_norm,
    linear_amx,
    linear_f32,
    pack_amx,
    pack_f32,
    paged_decode,
    rms_norm,
    rope,
    silu_and_mul,
    write_kv,
)


def causal_prefill(q, k, v, m: int) -> torch.Tensor | None:
    """Their causal attention, or None where this build has no kernel for them (no AVX-512, a dtype or
    head_dim without one, rows whose heads are not packed): the caller runs SDPA then."""
    d = q.shape[-1]
    if (q.dtype not in CHAINS or not avx512() or d not in (64, 128)
            or any(t.dim() != 3 or t.stride()[1:] != (d, 1) for t in (q, k, v))):
        return None
    return ops.causal_prefill(q, k, v, m)


def decode_layers(x, cos, sin, meta, weights: dict, *, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """A decode-only step's layers over x, the step's embeddings (rows, hidden), bf16 or fp32, which it
    overwrites with the last layer's output; returns the residual stream. meta: the step's AttentionMetadata;
    weights: LAYER_WEIGHTS -> one tensor per layer (the linears in their kernel's layout)."""
    return ops.decode_layers(x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
                             *(weights[k] for k in LAYER_WEIGHTS), heads, kv_heads, eps)
