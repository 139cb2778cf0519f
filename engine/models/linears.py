"""The linears' weight formats on a CPU, each computing F.linear's values (models.llama's Linear):

  fp32      F.linear, with the output features cut into one slice per thread (`linear`)
  oneDNN    bf16 weights packed once in oneDNN's blocked layout (`pack`, `packed_linear`)
  AMX       bf16 weights laid out once for the tile kernel of engine/cpu_kernels.cpp, for 1 to 32 rows

Each packed format is checked on a probe before a model uses it (packed_weights_work, amx_linears_work).
"""
from __future__ import annotations

import logging

import torch
from torch import nn
import torch.nn.functional as F

from engine import cpu_kernels

log = logging.getLogger("batchscope.engine")


SPLIT_ROWS = 256     # more rows than this: F.linear (split was no faster at 512)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on a CPU running several threads: there the output features are cut into one
    slice per thread and the slices computed as one batched matmul (a view of w, nothing copied), so
    every thread reads its own share of the weights. MKL runs a skinny fp32 matmul (a decode step's
    few rows) on one thread; cut this way the default model's linears took 1.3-1.6x less time on a
    2-core CPU at 1 to 32 rows, 1.15-1.3x at 128, and as long at 512, where MKL uses every thread
    itself (two runs of python -m demos.bench_ops; docs/results.md)."""
    t = torch.get_num_threads()
    if t == 1 or x.is_cuda or x.dtype != torch.float32 or w.shape[0] % t or x.shape[0] > SPLIT_ROWS:
        return F.linear(x, w, b)
    y = torch.bmm(x.expand(t, *x.shape), w.view(t, -1, w.shape[1]).transpose(1, 2))   # (t, rows, out / t)
    y = y.transpose(0, 1).reshape(x.shape[0], w.shape[0])
    return y if b is None else y + b


def packed_weights_work(dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold this dtype's weights in its own blocked layout (torch's mkldnn ops; the
    ones torch.compile uses on CPU) and computes bit for bit what F.linear does: checked on a probe."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(8, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return torch.equal(y, F.linear(x, w))
    except (RuntimeError, AttributeError):
        return False


def pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def amx_linears_work() -> bool:
    """Whether this CPU's AMX tile kernel (engine/cpu_kernels.linear_amx) runs here and computes bit for bit
    what F.linear does at every row count it is used for: checked on a probe (a partial column group too)."""
    if not cpu_kernels.amx_bf16():
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=g).to(torch.bfloat16)
    packed = cpu_kernels.pack_amx(w)
    for rows in (1, 7, 16, cpu_kernels.AMX_ROWS):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        if not torch.equal(cpu_kernels.linear_amx(x, packed, 80), F.linear(x, w)):
            log.warning("the AMX linears differ from F.linear at %d rows on this CPU: they stay off", rows)
            return False
    return True


class Linear(nn.Linear):
    """nn.Linear over a flat batch; on a CPU in bf16, over copies of the weight laid out once at load
    (LlamaForCausalLM.pack_weights) instead of re-laid out on every call, the same values either way:
    - `amx`: the AMX tile kernel's layout, for a decode step's 1 to 32 rows, where the CPU has AMX
      (engine/cpu_kernels.linear_amx: 1.3-1.5x less time than oneDNN's packed kernel);
    - `packed`: oneDNN's, for more rows, or every row count without AMX (1.2-1.4x less time than
      F.linear at 8 to 256 rows, the same at 2,048; docs/results.md)."""
    packed: torch.Tensor | None = None
    amx: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None and x.shape[0] <= cpu_kernels.AMX_ROWS:
            return cpu_kernels.linear_amx(x, self.amx, self.out_features)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias)
