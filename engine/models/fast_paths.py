"""The model's fast paths, each beside the plain function it stands in for (engine/models/llama.py calls them):

- Fused / FusedOps: the elementwise chains (RMSNorm, residual add + RMSNorm, RoPE, SiLU * up), in one pass of
  the CPU library or compiled on CUDA, else the plain functions of engine/kernels/reference.py;
- pack_weights: the linears' and the logits head's copies in the CPU kernels' layouts (the plain weights stay);
- decode_weights: what a decode step's layers in one call of the CPU library (ops.decode_step) read.

With the kernels off (BATCHSCOPE_CPU_KERNEL=0, enforce_eager) none of these changes what the model computes.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from engine.execution.backends import CpuAttention
from engine.kernels import cpu_kernels, ops
from engine.kernels.reference import add_rms_norm, apply_rope, rms_norm, silu_and_mul
from engine.models.linears import Linear, amx_linears_work, f32_linears_work, pack, packed_weights_work

log = logging.getLogger("batchscope.engine")


class Fused:
    """A chain of elementwise ops, with a faster form where one exists:
    - CUDA: torch.compile fuses it into one kernel while a decode step's CUDA graph is warmed up and
      captured (FusedOps.fusing): a captured decode step is ~45 tiny kernels per layer op by op, so
      launches, not bytes moved, would set its time. Eager steps (prefill, mixed) run the plain
      function: there a compiled region's guards and dispatch cost more host time than the fusion
      saves (docs/gpu.md).
    - CPU, bf16 and fp32: one pass of engine/kernels/cpu_kernels.cpp where that library built (the same values
      up to the last bit of an fp32 exp or rsqrt) instead of torch's several passes over memory, at every
      row count: a long prefill step's passes cost more than one, and a decode step's several small ops more
      than one checked call (docs/results.md, "The CPU kernels as checked ops").
    - Otherwise, or when `enabled` is off (enforce_eager): the plain function."""

    def __init__(self, fn, cpu_name: str, enabled: bool = True):
        self.fn, self.enabled, self.active, self.compiled = fn, enabled, False, None
        self.cpu_name, self.cpu = cpu_name, None

    def __call__(self, x, *args):
        if not x.is_cuda:
            if x.dtype not in cpu_kernels.CHAINS or not self.enabled:
                return self.fn(x, *args)
            if self.cpu is None:             # first call: the C++ form, or the plain one without it
                self.cpu = getattr(ops, self.cpu_name) if cpu_kernels.fused_chains() else self.fn
            return self.cpu(x, *args)
        if not (self.enabled and self.active):
            return self.fn(x, *args)
        if self.compiled is None:           # first call: compile, or stay unfused where that fails
            try:
                self.compiled = torch.compile(self.fn, dynamic=True)
                return self.compiled(x, *args)
            except Exception:
                log.exception("torch.compile failed on %s: it runs unfused", self.fn.__name__)
                self.compiled = self.fn
        return self.compiled(x, *args)



class FusedOps:
    """One model's elementwise chains (Fused), unless `enabled` is off."""

    def __init__(self, enabled: bool = True):
        self.rms_norm = Fused(rms_norm, "rms_norm", enabled)
        self.add_rms_norm = Fused(add_rms_norm, "add_rms_norm", enabled)
        self.apply_rope = Fused(apply_rope, "rope", enabled)
        self.silu_and_mul = Fused(silu_and_mul, "silu_and_mul", enabled)

    @contextmanager
    def fusing(self):
        """Inside: the compiled chains (CUDA-graph warm-up and capture). Outside: the plain functions."""
        chains = (self.rms_norm, self.add_rms_norm, self.apply_rope, self.silu_and_mul)
        for f in chains:
            f.active = True
        try:
            yield
        finally:
            for f in chains:
                f.active = False



def decode_weights(model) -> dict[str, list[torch.Tensor]]:
    """Each layer's weights (the linears in their kernel's layout) and KV cache, as ops.decode_step
    takes them: the tensors themselves, read at every call, so a cache the runner gave the layers later is
    the one used. The modules they are read from are found once (nn.Module's attribute lookup of a
    submodule is the slow part: a third of a millisecond a step for 30 layers)."""
    parts = getattr(model, "_decode_parts", None)
    if parts is None:
        parts = model._decode_parts = [(l.input_layernorm, l.self_attn, l.self_attn.qkv_proj, l.self_attn.o_proj,
                                        l.post_attention_layernorm, l.mlp.gate_up_proj, l.mlp.down_proj)
                                       for l in model.layers]
    kernel = lambda m: m.amx if m.amx is not None else m.f32       # noqa: E731
    rows = [(norm.weight, kernel(qkv), kernel(o), post.weight, kernel(gate_up), kernel(down),
             attn.k_cache, attn.v_cache)                                # in cpu_kernels.LAYER_WEIGHTS' order
            for norm, attn, qkv, o, post, gate_up, down in parts]
    out = {name: list(column) for name, column in zip(cpu_kernels.LAYER_WEIGHTS, zip(*rows))}
    return out


def pack_weights(model):
    """Every Linear and the logits matrix in oneDNN's layout, and for a decode step's few rows also in a
    kernel's of engine/kernels/cpu_kernels.cpp: bf16 where the CPU has AMX (bias-free linears whose sizes the
    tiles take); fp32 where it has AVX-512 in that kernel's layout alone, for every row count, and with AVX2
    in both, the kernel's for a decode step's few rows (cpu_kernels.f32_kernel_rows); each where it computes
    what F.linear does (packed_weights_work, amx_linears_work, f32_linears_work).
    The plain weights stay: the embedding shares the head's, and
    readers of the weights (weight_bytes, the int8 path, tests) see the usual tensors; each packed copy
    costs the linears' memory once more (270 MB for the default model in bf16, 540 MB in fp32)."""
    dtype = model.embed_tokens.weight.dtype
    if not packed_weights_work(dtype) or model.embed_tokens.weight.is_cuda:
        return
    amx = dtype == torch.bfloat16 and amx_linears_work()
    f32 = dtype == torch.float32 and f32_linears_work()
    f32_rows = cpu_kernels.f32_kernel_rows() if f32 else 0
    every_row = f32_rows == cpu_kernels.EVERY_ROW           # the kernel takes every row count: no oneDNN copy
    for m in model.modules():
        if isinstance(m, Linear):
            if f32 and m.out_features % 16 == 0:
                m.f32, m.f32_rows = ops.pack_f32(m.weight), f32_rows
                if every_row:
                    continue
            m.packed = pack(m.weight)
            if amx and m.bias is None and cpu_kernels.amx_shape_ok(*m.weight.shape):
                m.amx = ops.pack_amx(m.weight)
    f32_head = f32 and model.cfg.vocab_size % 16 == 0
    if f32_head:
        model.f32_head, model.f32_rows = ops.pack_f32(model.head_weight()), f32_rows
    if not (f32_head and every_row):
        model.packed_head = pack(model.head_weight())
    if amx and cpu_kernels.amx_shape_ok(*model.head_weight().shape):
        model.amx_head = ops.pack_amx(model.head_weight())
    # every piece of every layer has its kernel: the linears' (bias-free), paged attention, the C++ chains
    model.fused_decode = (amx or f32) and model.ops.rms_norm.enabled and cpu_kernels.fused_chains() and all(
        isinstance(l.self_attn.backend, CpuAttention) and not l.self_attn.qk_norm and
        all((m.amx is not None or m.f32 is not None) and m.bias is None
            for m in l.modules() if isinstance(m, Linear)) for l in model.layers)
    model.fused_rows = cpu_kernels.AMX_ROWS if amx else min(cpu_kernels.F32_ROWS, f32_rows)
