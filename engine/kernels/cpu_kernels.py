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
                 the model's elementwise chains (bf16, fp32) in one pass each (models.fast_paths.FusedOps)
  pack_amx, linear_amx
                 bf16 linears of 1 to 32 rows on AMX tiles, over weights laid out once for them
  pack_f32, linear_f32
                 fp32 linears on AVX-512, over weights laid out once for them
  decode_layers  a decode step's layers in one call of the kernels above, in the model's order, given the
                 layers' weights and caches as tensors (models.fast_paths.decode_weights)

Building, the child-process probe and the OpenMP runtime: engine/kernels/build.py. No compiler, a failed
build or a probe that died: `library()` is None and the engine takes the plain path.
"""
from __future__ import annotations

import torch

from engine.kernels.loading import (  # noqa: F401  (the interface the core calls reads them here)
    AMX_ROWS,
    CHAINS,
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
    f32_linears,
    fused_chains,
    lib_or_fail,
    library,
    supports,
    threads,
)


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




def decode_layers(x, cos, sin, meta, weights: dict, *, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """A decode-only step's layers over x, the step's embeddings (rows, hidden), bf16 or fp32, which it
    overwrites with the last layer's output; returns the residual stream. meta: the step's AttentionMetadata;
    weights: LAYER_WEIGHTS -> one tensor per layer (the linears in their kernel's layout)."""
    return torch.ops.batchscope.decode_layers(x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
                                              *(weights[k] for k in LAYER_WEIGHTS), heads, kv_heads, eps)


from engine.kernels import ops  # noqa: E402,F401  (registers torch.ops.batchscope.*)
