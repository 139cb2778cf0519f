"""The model's fast paths, each beside the plain function it stands in for (engine/models/llama.py calls them):

- Fused / FusedOps: the elementwise chains (RMSNorm, residual add + RMSNorm, RoPE, SiLU * up), in one pass of
  the CPU library or compiled on CUDA, else the plain functions of engine/kernels/reference.py;
- pack_weights: the linears' and the logits head's copies in the CPU kernels' layouts (the plain weights stay);
- decode_weights: what a decode step's layers in one call of the CPU library (ops.decode_step) read;
- Linear and its weight formats (below).

With the kernels off (BATCHSCOPE_CPU_KERNEL=0, enforce_eager) none of these changes what the model computes.

The linears' weight formats on a CPU (models.llama's Linear):

  plain     F.linear, with the output features cut into one slice per thread (`linear`): where no
            format below is made
  oneDNN    weights packed once in oneDNN's blocked layout (`pack`, `packed_linear`): bf16 and fp32
  AMX       bf16 weights laid out once for the tile kernel of engine/kernels/cpu_kernels.cpp, for 1 to 32 rows
  f32       fp32 weights laid out once for the kernel of engine/kernels/cpu_kernels.cpp: for every row count
            with AVX-512, for a decode step's few rows with AVX2 (oneDNN's copy beside it for more)

In bf16 every format computes F.linear's values bit for bit (AMX: as oneDNN's tile kernels sum them at
every row count, reference.linear_tiles; one row through F.linear sums in another order). In fp32 oneDNN
and the f32 kernel each sum in their own order (MKL, behind F.linear, in its own): the same values up to
fp32 rounding, the f32 kernel's the same whatever else shares the step. Each format is checked on a probe
before a model uses it (packed_weights_work, amx_linears_work, f32_linears_work).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.backends import CpuAttention
from engine.kernels import cpu_kernels, ops, reference
from engine.kernels.reference import add_rms_norm, apply_rope, rms_norm, silu_and_mul

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


# ---- the linears' weight formats ----
SPLIT_ROWS = 256     # more rows than this: F.linear, which then uses every thread itself


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on a CPU running several threads: there the output features are cut into one
    slice per thread and the slices computed as one batched matmul (a view of w, nothing copied), so
    every thread reads its own share of the weights. MKL runs a skinny fp32 matmul (a decode step's
    few rows) on one thread, so a decode step's linears leave the other cores idle without this; at
    many rows MKL uses every thread itself (python -m demos.bench.ops; docs/results.md)."""
    t = torch.get_num_threads()
    if t == 1 or x.is_cuda or x.dtype != torch.float32 or w.shape[0] % t or x.shape[0] > SPLIT_ROWS:
        return F.linear(x, w, b)
    y = torch.bmm(x.expand(t, *x.shape), w.view(t, -1, w.shape[1]).transpose(1, 2))   # (t, rows, out / t)
    y = y.transpose(0, 1).reshape(x.shape[0], w.shape[0])
    return y if b is None else y + b


def close_to_f_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    """y is F.linear's values: bit for bit in bf16; in fp32 within what summing in another order moves
    (a few units in the last place of the largest products' sum)."""
    ref = F.linear(x, w, b)
    if y.dtype != torch.float32:
        return torch.equal(y, ref)
    bound = 1e-5 * (x.abs() @ w.abs().T + (0 if b is None else b.abs()))
    return bool(((y - ref).abs() <= bound).all())


def packed_weights_work(dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold this dtype's weights in its own blocked layout (torch's mkldnn ops; the
    ones torch.compile uses on CPU) and computes what F.linear does (close_to_f_linear): checked on a probe."""
    if dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(8, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return close_to_f_linear(y, x, w)
    except (RuntimeError, AttributeError):
        return False


def pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w)


def padded_rows(rows: int) -> int:
    """The row count packed_linear hands oneDNN for `rows` rows: up to 16 exactly, above that the next
    multiple of a sixteenth of the power of two at or below `rows` (16 sizes per power of two, at most
    1/16 more rows than asked)."""
    step = max(1, (1 << (rows.bit_length() - 1)) // 16)
    return -(-rows // step) * step


def _onednn(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ b) on weights in oneDNN's layout. oneDNN builds one primitive per input shape and keeps
    it, with buffers of that shape, in a cache of about a thousand; a flat batch's row count changes from
    step to step, so a server fed every row count grew by gigabytes. Rows are padded with zeros up to
    padded_rows (a few sizes, as CUDA graphs are captured for a few batch sizes) and cut off again."""
    rows = x.shape[0]
    padded = padded_rows(rows) if rows else rows
    if padded == rows:
        return _onednn(x, packed, b)
    return _onednn(F.pad(x, (0, 0, 0, padded - rows)), packed, b)[:rows]


def amx_linears_work() -> bool:
    """Whether this CPU's AMX tile kernel (engine/ops.linear_amx) runs here and computes bit for bit
    what oneDNN's tile kernels behind F.linear do (reference.linear_tiles) at every row count it is used
    for: checked on a probe (a partial column group too)."""
    if not cpu_kernels.amx_bf16():
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=g).to(torch.bfloat16)
    packed = ops.pack_amx(w)
    for rows in (1, 7, 16, cpu_kernels.AMX_ROWS):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        if not torch.equal(ops.linear_amx(x, packed, 80), reference.linear_tiles(x, w)):
            log.warning("the AMX linears differ from oneDNN's at %d rows on this CPU: they stay off", rows)
            return False
    return True


def f32_linears_work() -> bool:
    """Whether this CPU runs the fp32 kernel (engine/ops.linear_f32) and it computes F.linear's values
    (close_to_f_linear), each row's the same at every row count: checked on a probe (a partial group too)."""
    if not cpu_kernels.f32_linears():
        return False
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(80, 72, generator=g), torch.randn(80, generator=g)
    packed = ops.pack_f32(w)
    x = torch.randn(300, 72, generator=g)
    ys = {rows: ops.linear_f32(x[:rows], packed, 80, b) for rows in (1, 7, 13, 300)}
    if all(close_to_f_linear(y, x[:rows], w, b) and torch.equal(y, ys[300][:rows])
           for rows, y in ys.items()):
        return True
    log.warning("the fp32 linear kernel differs from F.linear on this CPU: it stays off")
    return False


class Linear(nn.Linear):
    """nn.Linear over a flat batch; on a CPU, over copies of the weight laid out once at load
    (models.fast_paths.pack_weights) instead of re-laid out on every call:
    - `amx`: bf16, the AMX tile kernel's layout, for a decode step's 1 to 32 rows, where the CPU has AMX
      (engine/ops.linear_amx, which streams the weights once per step);
    - `f32`: fp32, the kernel's layout (engine/ops.linear_f32), up to `f32_rows` rows: every row
      count with AVX-512, where no oneDNN copy is kept beside it (it was no faster at any row count), and
      a decode step's few rows with AVX2 (cpu_kernels.f32_kernel_rows), oneDNN's copy taking more;
    - `packed`: oneDNN's, for more rows, or every row count without the kernels above (a layout made once
      instead of on every call; each choice is measured in docs/results.md)."""
    packed: torch.Tensor | None = None
    amx: torch.Tensor | None = None
    f32: torch.Tensor | None = None
    f32_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None and x.shape[0] <= cpu_kernels.AMX_ROWS:
            return ops.linear_amx(x, self.amx, self.out_features)
        if self.f32 is not None and x.shape[0] <= self.f32_rows:
            return ops.linear_f32(x, self.f32, self.out_features, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias)
