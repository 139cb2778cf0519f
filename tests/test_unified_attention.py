"""The unified Triton attention kernel (engine/execution/triton_attention.py) against an fp64 reference, on random
ragged batches: decodes only, chunks only, both; cached prefixes; padded tokens and sequences; block
sizes 16-256; grouped-query ratios 1-8; fp32, bf16 and fp16 caches; with and without split-K.
On a CPU Triton's interpreter runs it (slow: many short cases, a few long ones)."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # triton reads this once, when it is first imported


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("triton")
    if not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("triton was imported before this module could turn its interpreter on")
    import engine.execution.triton_attention as ta
    return ta


def reference(q, k_cache, v_cache, tables, cu_q, seq_lens):
    """fp64: each sequence's query rows over its context, causal at their positions, K/V heads repeated."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for s in range(len(seq_lens)):
        a, b, ctx = int(cu_q[s]), int(cu_q[s + 1]), int(seq_lens[s])
        if a == b:
            continue
        k = k_cache[tables[s]].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        v = v_cache[tables[s]].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,thd->hqt", q[a:b].double(), k) * q.shape[-1] ** -0.5
        q_pos = torch.arange(ctx - (b - a), ctx)
        scores = scores.masked_fill(torch.arange(ctx)[None, None] > q_pos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)
    return out


def make_batch(rng: random.Random, decodes: list[int], chunks: list[tuple[int, int]], block_size: int,
               kv_heads: int, group: int, head_dim: int, dtype, pad_tokens: int, pad_seqs: int):
    """decodes: context lengths; chunks: (cached tokens before, chunk length). Returns the kernel's inputs,
    padded like a CUDA-graph bucket: pad_tokens extra query rows, pad_seqs sequences of length 0."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q_lens = [1] * len(decodes) + [n for _, n in chunks]
    ctx = list(decodes) + [c + n for c, n in chunks]
    width = max(-(-c // block_size) for c in ctx)
    num_blocks = sum(-(-c // block_size) for c in ctx) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()      # each sequence owns scattered blocks
    tables, used = [], 0
    for c in ctx:
        n = -(-c // block_size)
        tables.append(perm[used:used + n] + [perm[-1]] * (width - n))
        used += n
    tables += [[perm[-1]] * width] * pad_seqs
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    cu += [cu[-1]] * pad_seqs
    num_tokens = cu[-1] + pad_tokens
    # q as the model passes it: a view into a wider (tokens, heads + 2 kv_heads, head_dim) tensor
    qkv = torch.randn(num_tokens, kv_heads * (group + 2), head_dim, generator=g).to(dtype)
    q = qkv[:, :kv_heads * group]
    return (q, k_cache, v_cache, torch.tensor(tables), torch.tensor(cu), torch.tensor(ctx + [0] * pad_seqs)), cu[-1]


def check(kernel, inputs, real_tokens, splits, block_m, dtype):
    ref = reference(*inputs)[:real_tokens]
    out = kernel.unified_attention(*(x.to(DEVICE) for x in inputs), num_splits=splits, block_m=block_m).cpu()
    assert out.dtype == dtype and out.shape == inputs[0].shape
    got = out[:real_tokens].double()
    err = ((got - ref).norm() / ref.norm()).item()
    worst = (got - ref).abs().max().item()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert err < tol and worst < 50 * tol, (err, worst)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_case(i: int) -> dict:
    """Short contexts (the interpreter is slow): a kind, a layout and a dtype per seed."""
    rng = random.Random(i)
    kind = ("decodes", "chunks", "both")[i % 3]
    block_size = rng.choice([16, 32, 64, 128, 256])
    decodes = [rng.randint(1, 300) for _ in range(rng.randint(1, 5))] if kind != "chunks" else []
    chunks = [(rng.choice([0, 0, rng.randint(1, 200)]), rng.randint(1, 40)) for _ in range(rng.randint(1, 3))] \
        if kind != "decodes" else []
    return dict(rng=rng, decodes=decodes, chunks=chunks, block_size=block_size, kv_heads=rng.choice([1, 2]),
                group=rng.choice([1, 2, 3, 4, 7, 8]), head_dim=rng.choice([16, 32, 64]), dtype=DTYPES[i % 3],
                pad_tokens=rng.choice([0, 0, 3, 17]), pad_seqs=rng.choice([0, 1, 4]),
                splits=rng.choice([1, 1, 2, 5]), block_m=rng.choice([16, 16, 64]))


@pytest.mark.parametrize("seed", range(24))
def test_random_ragged_batches(kernel, seed):
    c = random_case(seed)
    splits, block_m = c.pop("splits"), c.pop("block_m")
    inputs, real = make_batch(**c)
    check(kernel, inputs, real, splits, block_m, c["dtype"])


@pytest.mark.parametrize("name, decodes, chunks, block_size, group, dtype, splits, block_m", [
    # few long decodes: the split-K case
    ("long decodes", [3000, 1, 1500], [], 256, 7, torch.bfloat16, 8, 16),
    # a chunk whose prefix (earlier chunks or a prefix-cache hit) is long, beside decodes
    ("chunk after a long prefix", [2100, 16], [(2000, 24)], 16, 4, torch.float32, 1, 64),
    ("chunk after a long prefix, split", [], [(1200, 9), (0, 33)], 128, 8, torch.float16, 3, 16),
])
def test_long_contexts(kernel, name, decodes, chunks, block_size, group, dtype, splits, block_m):
    inputs, real = make_batch(random.Random(name), decodes, chunks, block_size, kv_heads=2, group=group,
                              head_dim=64, dtype=dtype, pad_tokens=5, pad_seqs=2)
    check(kernel, inputs, real, splits, block_m, dtype)


def test_padding_rows_are_left_alone_and_only_real_rows_written(kernel):
    """Programs past the real work exit at once: padded rows of `out` keep what they held."""
    inputs, real = make_batch(random.Random(5), [9, 30], [(0, 12)], 16, kv_heads=2, group=2, head_dim=32,
                              dtype=torch.float32, pad_tokens=11, pad_seqs=3)
    out = torch.full(inputs[0].shape, 7.0, device=DEVICE)
    kernel.unified_attention(*(x.to(DEVICE) for x in inputs), out=out)
    assert torch.all(out[real:] == 7.0) and not torch.any(out[:real] == 7.0)


def test_grid_depends_only_on_padded_sizes(kernel):
    """The launch bound covers every real q-block of any batch of those padded sizes."""
    for bq in (1, 2, 4, 16):
        rng = random.Random(bq)
        for _ in range(200):
            lens = [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
            starts, cu = [], 0
            for s, n in enumerate(lens):
                starts.append(cu // bq + s)
                cu += n
            needed = max(st + -(-n // bq) for st, n in zip(starts, lens))
            assert needed <= kernel.num_qblocks(cu + rng.randint(0, 9), len(lens) + rng.randint(0, 3), bq)
    assert kernel.block_q_for(7) == 2 and kernel.block_q_for(1) == 16 and kernel.block_q_for(16) == 1
    assert kernel.block_q_for(32) == 1 and kernel.block_q_for(2, block_m=64) == 32


AOT_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from engine.execution.triton_attention import _unified_kernel
ints = ["num_seqs", "num_splits", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_bt",
        "stride_ot", "stride_oh", "stride_osp"]
for dtype, split, group, head_dim, bq in [("bf16", False, 7, 64, 2), ("bf16", True, 6, 128, 2),
                                          ("fp32", False, 4, 64, 4), ("fp16", False, 1, 64, 64)]:
    sig = {"out_ptr": "*fp32" if split else "*" + dtype, "lse_ptr": "*fp32", "q_ptr": "*" + dtype,
           "k_cache_ptr": "*" + dtype, "v_cache_ptr": "*" + dtype, "block_tables_ptr": "*i64",
           "cu_q_ptr": "*i64", "seq_lens_ptr": "*i64", "scale": "fp32", **{k: "i32" for k in ints}}
    consts = dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=bq, HEAD_DIM=head_dim,
                  BLOCK_SIZE=16, TILE=2048 // head_dim, SPLIT=split, PRECISION="ieee" if dtype == "fp32" else "tf32")
    sig.update({k: "constexpr" for k in consts})
    src = triton.compiler.ASTSource(fn=_unified_kernel, signature=sig, constexprs=consts)
    assert triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32)).asm["cubin"]
"""


@pytest.mark.parametrize("capability", [80, 90])   # A100 (and the sm_8x family); H100/H200
def test_kernel_compiles_for_gpus(capability):
    """Compiled ahead of time to machine code by the ptxas in the triton wheel: no GPU needed. In a fresh
    process, since the interpreter (on in this one) replaces the compiler's front end."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT_COMPILE, str(capability)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
