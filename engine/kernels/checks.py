"""What every CPU op checks before a pointer reaches C++ (engine/kernels/cpu_kernels.py): each failure is a
ValueError that names the argument and what it should be. Plain `if`s, never `assert` (python -O drops those).

They run on every call, so they are written to cost well under a microsecond each: attribute reads and
comparisons, no new tensors, no formatting until something fails (a decode step makes about 200 op
calls; `python -m demos.bench.ops --only chains,kv_write` sets them beside torch at 1 row). Index bounds
(slots, block ids, context lengths) cost a min and a max per index tensor; a step's metadata tensors are
the same objects in all of its layers, so `ids` checks each tensor once per bound and remembers it (a weak
reference and the tensor's version counter where it has one: inference tensors have none, and the runner
builds its metadata once per step and never writes it). A new tensor, as a direct call passes, is always checked."""
from __future__ import annotations

import weakref

import torch

_CHECKED: dict[int, tuple] = {}      # id(tensor) -> (weak reference, version, low, high) of a passed check


def fail(name: str, problem: str):
    raise ValueError(f"{name}: {problem}")


def tensor(name: str, t, dims: int | None = None, dtype: torch.dtype | tuple | None = None) -> torch.Tensor:
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


def shape(name: str, t: torch.Tensor, want: tuple):
    """t's shape is `want` (None: any size there)."""
    have = t.shape
    if have == want:
        return
    if len(have) != len(want) or any(w is not None and s != w for s, w in zip(have, want)):
        fail(name, f"must have shape {tuple('*' if w is None else w for w in want)}, has {tuple(t.shape)}")


def contiguous(name: str, t: torch.Tensor):
    if not t.is_contiguous():
        fail(name, f"must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def inner_rows(name: str, t: torch.Tensor):
    """(rows, heads, head_dim) whose rows may be strided but each row's heads lie packed."""
    (rows, heads, d), (s0, s1, s2) = t.shape, t.stride()
    if d > 1 and s2 != 1 or heads > 1 and s1 != d:
        fail(name, f"each row's heads must lie packed (strides {t.stride()} for shape {tuple(t.shape)})")
    if rows > 1 and s0 < heads * d:
        fail(name, f"rows overlap (strides {t.stride()} for shape {tuple(t.shape)})")


def divides(name: str, a: int, b: int, b_name: str):
    if a <= 0 or b % a:
        fail(name, f"{a} does not divide {b_name} ({b})")


def ids(name: str, t: torch.Tensor, low: int, high: int, what: str):
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
