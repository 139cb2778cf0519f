"""What every CPU op checks before a pointer reaches C++ (engine/kernels/cpu_kernels.py): each failure is a
ValueError that names the argument and what it should be. Plain `if`s, never `assert` (python -O drops those).

Shapes, strides and dtypes cost nothing next to a kernel. Index bounds (slots, block ids, context lengths)
cost one min/max per index tensor, ~4 us on a decode step's few dozen ids: checked on every call, since a
bad id in C++ is a write anywhere in the process."""
from __future__ import annotations

import torch


def fail(name: str, problem: str):
    raise ValueError(f"{name}: {problem}")


def tensor(name: str, t, dims: int | None = None, dtype: torch.dtype | tuple | None = None) -> torch.Tensor:
    """A CPU tensor of `dims` dimensions and `dtype` (or one of them)."""
    if not isinstance(t, torch.Tensor):
        fail(name, f"expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        fail(name, f"must be on the CPU, is on {t.device}")
    if dims is not None and t.dim() != dims:
        fail(name, f"must have {dims} dimensions, has shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        fail(name, f"must be {dtype}, is {t.dtype}")
    return t


def same_dtype(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str):
    if t.dtype != like.dtype:
        fail(name, f"is {t.dtype} while {like_name} is {like.dtype}")


def shape(name: str, t: torch.Tensor, want: tuple):
    """t's shape is `want` (None: any size there)."""
    if t.dim() != len(want) or any(w is not None and s != w for s, w in zip(t.shape, want)):
        fail(name, f"must have shape {tuple('*' if w is None else w for w in want)}, has {tuple(t.shape)}")


def contiguous(name: str, t: torch.Tensor):
    if not t.is_contiguous():
        fail(name, f"must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def inner_rows(name: str, t: torch.Tensor):
    """(rows, heads, head_dim) whose rows may be strided but each row's heads lie packed."""
    if t.shape[2] > 1 and t.stride(2) != 1 or t.shape[1] > 1 and t.stride(1) != t.shape[2]:
        fail(name, f"each row's heads must lie packed (strides {t.stride()} for shape {tuple(t.shape)})")
    if t.shape[0] > 1 and t.stride(0) < t.shape[1] * t.shape[2]:
        fail(name, f"rows overlap (strides {t.stride()} for shape {tuple(t.shape)})")


def divides(name: str, a: int, b: int, b_name: str):
    if a <= 0 or b % a:
        fail(name, f"{a} does not divide {b_name} ({b})")


def ids(name: str, t: torch.Tensor, low: int, high: int, what: str):
    """Every value of the int64 tensor t in [low, high); `what` says where high comes from."""
    if t.numel():
        lo, hi = (int(v) for v in torch.aminmax(t))
        if lo < low or hi >= high:
            fail(name, f"holds {lo if lo < low else hi}, outside [{low}, {high}) ({what})")
