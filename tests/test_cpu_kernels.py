"""The CPU backend (engine.execution.backends.CpuAttention: the paged decode kernel of engine/kernels/cpu_kernels.cpp
and its own layout inside a block) against the portable backend on random ragged batches, in float32 and
bfloat16; what it writes into the cache; and that attention falls back to the portable path where the
kernel cannot be built."""
import shutil

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.execution.attention import AttentionMetadata, PrefillChunk, TorchAttention
from engine.execution.backends import CpuAttention, select_backend
from engine.kernels import build, cpu_kernels, ops, reference
from tests.helpers import at_once

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler: the kernel cannot be built")

NUM_BLOCKS = 40


def to_kernel_layout(cache: torch.Tensor, keys: bool) -> torch.Tensor:
    """(blocks, block_size, kv_heads, head_dim) in token order -> the same shape holding CpuAttention's layout."""
    inner = cache.permute(0, 2, 3, 1) if keys else cache.permute(0, 2, 1, 3)
    return inner.contiguous().view(cache.shape)


def batch(data, bs: int, hd: int, dtype):
    kv = data.draw(st.integers(1, 3))
    heads = kv * data.draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k_cache = torch.randn(NUM_BLOCKS, bs, kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, bs, kv, hd, generator=g).to(dtype)
    decodes = data.draw(st.lists(st.integers(1, 3 * bs), max_size=6))          # context lengths
    chunks = data.draw(st.lists(st.tuples(st.integers(1, bs + 3), st.integers(0, bs + 5)), max_size=3))
    free = data.draw(st.permutations(range(NUM_BLOCKS)))
    slots, start, tables, ctxs, rows = [], 0, [], [], []
    for n, ctx in [(1, c) for c in decodes] + [(n, cached + n) for n, cached in chunks]:
        table = [free.pop() for _ in range(-(-ctx // bs))]
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
        tables.append(table)
        ctxs.append(ctx)
        rows.append((start, n))
        start += n
    if not start:
        return None
    # q is a view with strided rows, as the model passes it (q's heads beside k's in one projection)
    q = torch.randn(start, heads + kv, hd, generator=g).to(dtype)[:, :heads]
    k, v = torch.randn(start, kv, hd, generator=g).to(dtype), torch.randn(start, kv, hd, generator=g).to(dtype)
    width = max(map(len, tables))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), context_lens=torch.tensor(ctxs),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             num_decodes=len(decodes), decode_ctx=list(decodes))
    for (first, n), ctx, table in list(zip(rows, ctxs, tables))[len(decodes):]:
        mask = None if ctx == n else torch.arange(ctx)[None] <= torch.arange(ctx - n, ctx)[:, None]
        meta.prefills.append(PrefillChunk(first, n, ctx, torch.tensor(table), mask))
    return q, k, v, k_cache, v_cache, meta


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(sorted(cpu_kernels.SHAPES)), st.sampled_from([torch.float32, torch.bfloat16]))
def test_cpu_backend_matches_the_portable_one(data, shape, dtype):
    made = batch(data, *shape, dtype)
    if made is None:
        return
    q, k, v, k_cache, v_cache, meta = made
    kt, vt = to_kernel_layout(k_cache, True), to_kernel_layout(v_cache, False)
    expected = TorchAttention()(q, k, v, k_cache, v_cache, meta)       # writes k, v into its cache first
    out = CpuAttention()(q, k, v, kt, vt, meta)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    # the same tokens were written, each where the kernel's layout puts it
    assert torch.equal(kt, to_kernel_layout(k_cache, True)) and torch.equal(vt, to_kernel_layout(v_cache, False))


@given(st.integers(1, 40), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
@example(ctx=1, seed=0)                     # one token: the softmax over a single score
@example(ctx=16, seed=0)                    # exactly one full block
def test_decode_kernel_matches_fp64_attention(ctx, seed):
    g = torch.Generator().manual_seed(seed)
    bs, kv, heads, hd = 16, 2, 6, 64
    k_cache, v_cache = torch.randn(8, bs, kv, hd, generator=g), torch.randn(8, bs, kv, hd, generator=g)
    table = torch.randperm(8, generator=g)[:-(-ctx // bs)]
    q = torch.randn(1, heads, hd, generator=g)
    keys = k_cache[table].flatten(0, 1)[:ctx].double().repeat_interleave(heads // kv, 1)     # (ctx, heads, hd)
    vals = v_cache[table].flatten(0, 1)[:ctx].double().repeat_interleave(heads // kv, 1)
    ref = torch.einsum("ht,thd->hd", torch.einsum("hd,thd->ht", q[0].double(), keys).div(hd ** 0.5).softmax(-1), vals)
    out = ops.paged_decode(q, to_kernel_layout(k_cache, True), to_kernel_layout(v_cache, False),
                           table[None], torch.tensor([ctx]))
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(ctx=st.integers(1, 80), at=st.integers(0, 79), bad=st.sampled_from([float("nan"), float("inf")]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
@example(ctx=1, at=0, bad=float("nan"), dtype=torch.float32, seed=0)     # the first score: where the max starts
@example(ctx=40, at=39, bad=float("nan"), dtype=torch.bfloat16, seed=0)  # past the last 16 in step: the tail
def test_a_non_finite_key_makes_its_sequences_attention_non_finite_and_no_others(ctx, at, bad, dtype, seed):
    """The softmax's maximum is taken 16 lanes at a time without assuming finite math; wherever a NaN or an
    infinity lies among a sequence's scores (first, in the 16-wide part, in the tail), that sequence's output
    is non-finite, so the engine fails its request, and the other sequence's is the reference's."""
    at = at % ctx
    g = torch.Generator().manual_seed(seed)
    bs, kv, heads, hd = 16, 1, 3, 64
    k_cache, v_cache = torch.randn(12, bs, kv, hd, generator=g), torch.randn(12, bs, kv, hd, generator=g)
    tables = torch.randperm(12, generator=g)[:12].view(2, 6)
    q, lens = torch.randn(2, heads, hd, generator=g).to(dtype), torch.tensor([ctx, 50])
    k_cache[tables[0, at // bs], at % bs, 0, :] = bad
    kc, vc = to_kernel_layout(k_cache, True).to(dtype), to_kernel_layout(v_cache, False).to(dtype)
    out = ops.paged_decode(q, kc, vc, tables, lens)
    assert not out[0].isfinite().any()
    want = reference.paged_decode(q, kc, vc, tables, lens)
    torch.testing.assert_close(out[1].float(), want[1].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not cpu_kernels.avx512(), reason="the CPU kernels were built without AVX-512")
@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 4), q_len=st.integers(1, 300), d=st.sampled_from([64, 128]), kv_heads=st.integers(1, 3),
       group=st.integers(1, 4), seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 3.0]))
@example(m=8, q_len=256, d=64, kv_heads=3, group=3, seed=0, scale=1.0)     # the default model's 8 x 256 prefill
def test_causal_prefill_kernel_matches_fp64_attention(m, q_len, d, kv_heads, group, seed, scale):
    check_causal(m, q_len, d, kv_heads, group, seed, scale, torch.float32)


@pytest.mark.skipif(not cpu_kernels.avx512(), reason="the CPU kernels were built without AVX-512")
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 4), q_len=st.integers(1, 300), d=st.sampled_from([64, 128]), kv_heads=st.integers(1, 3),
       group=st.integers(1, 4), seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 3.0]))
def test_causal_prefill_kernel_in_bf16_is_fp32_attention_rounded_once(m, q_len, d, kv_heads, group, seed, scale):
    check_causal(m, q_len, d, kv_heads, group, seed, scale, torch.bfloat16)


def check_causal(m, q_len, d, kv_heads, group, seed, scale, dtype):
    """Fresh prompt chunks side by side, as rows of the fused q/k/v projection (strided views): every
    length (block tails), head size and group, against causal attention in fp64: within fp32's rounding of
    the values' size (SDPA is closer still: it sums a score in blocks, the kernel in order over head_dim)."""
    from engine.execution.attention import batched
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    qkv = (torch.randn(m * q_len, heads + 2 * kv_heads, d, generator=g) * scale).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    got = ops.causal_prefill_or_none(q, k, v, m)
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(batched(t.double(), m) for t in (q, k, v)), is_causal=True, enable_gqa=True).transpose(1, 2).reshape(q.shape)
    assert got.shape == q.shape and got.dtype == dtype
    err = (got.double() - exact).abs()
    if dtype == torch.bfloat16:      # fp32 attention, each output rounded once: within one bf16 step of exact
        assert (err <= exact.abs() * 2 ** -8 + 1e-5 * v.abs().max().item()).all(), err.max().item()
        return
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(batched(t, m) for t in (q, k, v)), is_causal=True, enable_gqa=True).transpose(1, 2).reshape(q.shape)
    sdpa_err = (sdpa.double() - exact).abs().max().item()
    assert err.max().item() <= 4 * sdpa_err + 1e-5 * v.abs().max().item(), (err.max().item(), sdpa_err)


def test_the_causal_kernel_takes_fp32_and_bf16_and_the_backend_falls_back_to_sdpa():
    from engine.execution.attention import TorchAttention
    from engine.execution.backends import CpuAttention
    q, k, v = torch.randn(20, 4, 64), torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    assert ops.causal_prefill_or_none(q.half(), k.half(), v.half(), 2) is None
    assert ops.causal_prefill_or_none(q[:, :, :48].contiguous(), k[:, :, :48].contiguous(),
                                      v[:, :, :48].contiguous(), 2) is None        # head_dim 48: no kernel
    for t, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 1e-3)):
        got = CpuAttention().causal(q.to(t), k.to(t), v.to(t), 2)
        torch.testing.assert_close(got, TorchAttention().causal(q.to(t), k.to(t), v.to(t), 2), rtol=tol, atol=tol)


def test_shapes_without_a_kernel_are_refused():
    q = torch.randn(1, 2, 32)
    cache = torch.zeros(4, 16, 1, 32)
    with pytest.raises(ValueError, match="head_dim 32"):
        ops.paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    assert not cpu_kernels.supports(torch.float16, 16, 64) and not cpu_kernels.supports(torch.float32, 8, 64)


def test_selection_and_fallback_without_a_compiler(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, 16, 64, torch.bfloat16).name == "cpu-paged"
    assert select_backend("cpu", cpu, 16, 64, torch.float32).name == "cpu-paged"
    assert select_backend("torch", cpu, 16, 64, torch.bfloat16).name == "torch-sdpa"
    assert select_backend("auto", cpu, 16, 80, torch.float32).name == "torch-sdpa"   # no kernel for head_dim 80
    monkeypatch.setenv("BATCHSCOPE_CACHE", str(tmp_path))      # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None                    # a warning, not an error: the engine still starts
        assert select_backend("auto", cpu, 16, 64, torch.float32).name == "torch-sdpa"
        with pytest.raises(ValueError, match="attention_backend='cpu' needs a C\\+\\+ compiler"):
            select_backend("cpu", cpu, 16, 64, torch.float32)
        assert not list(tmp_path.glob("kernels/*.so"))
    finally:
        cpu_kernels.library.cache_clear()


def test_a_build_is_reused_and_named_by_what_it_was_built_from(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSCOPE_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is not None
        built = list((tmp_path / "kernels").glob("*.so"))
        assert built[0].with_suffix(".probed").exists()              # probed once, in a child process
        assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
        stamp = built[0].stat().st_mtime_ns
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() is not None and built[0].stat().st_mtime_ns == stamp   # loaded, not rebuilt
        # another CPU: another name, built and probed for it (the build and the probe above are real; here
        # they are recorded, the build a copy of the first, so the suite does not compile the library twice)
        made, probed = [], []

        def copy_build(cxx, out):
            made.append(out)
            shutil.copy(built[0], out)

        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags : another cpu")
        monkeypatch.setattr(build, "build", copy_build)
        monkeypatch.setattr(build, "probe", lambda path: probed.append(path))     # None: it passed
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() is not None
        assert made == probed and len(made) == 1 and made[0] != built[0] and made[0].name.startswith("cpu_kernels-")
        assert sorted((tmp_path / "kernels").glob("*.so")) == sorted([built[0], made[0]])
    finally:
        cpu_kernels.library.cache_clear()


def test_processes_starting_at_once_build_and_probe_the_library_once(tmp_path, monkeypatch):
    """Processes starting together on a fresh cache (a test run's workers, servers started at once): one builds
    and probes the library, the others wait for it and load its file. Before, each compiled its own copy and
    probed it, and the last rename won."""
    import time
    out = build.library_path(cpu_kernels.compiler() or "g++", cpu_kernels.cpu_flags(), tmp_path)
    made, probed, inside, seen = [], [], [], []

    def slow_build(cxx, path):
        inside.append(1)
        assert len(inside) == 1, "two builds at once"
        made.append(path)
        time.sleep(0.3)                     # long enough for the others to arrive and wait
        path.write_bytes(b"built")
        inside.pop()

    def stamping_probe(path):               # as build.probe: a stamp beside the library, the child run once
        seen.append(path.read_bytes())
        stamp = path.with_suffix(".probed")
        if not stamp.exists():
            probed.append(path)
            time.sleep(0.1)
            stamp.write_text("ok")
    monkeypatch.setattr(build, "build", slow_build)
    monkeypatch.setattr(build, "probe", stamping_probe)
    got, errors = at_once(lambda: build.ready("g++", out))
    assert not errors and got == [None] * 4
    assert made == [out] and probed == [out] and seen == [b"built"] * 4   # nobody saw a half-built file


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linears_compute_what_f_linear_does(dtype):
    """bf16: bit for bit; fp32: oneDNN sums in its own order (close_to_f_linear)."""
    from engine.models.fast_paths import Linear, close_to_f_linear, pack, packed_weights_work
    if not packed_weights_work(dtype):
        pytest.skip(f"this torch has no oneDNN {dtype} linear")
    g = torch.Generator().manual_seed(0)
    for rows, bias in [(1, False), (32, True), (300, False)]:
        lin = Linear(576, 960, bias=bias).to(dtype).requires_grad_(False)
        lin.weight.copy_(torch.randn(960, 576, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(960, generator=g))
        x = torch.randn(rows, 576, generator=g).to(dtype)
        lin.packed = pack(lin.weight)
        assert close_to_f_linear(lin(x), x, lin.weight, lin.bias)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4096), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_linears_see_few_row_counts_and_keep_every_row(rows, bias, seed):
    """oneDNN builds, and keeps, one primitive per input shape, with buffers of that shape: fed every row
    count a flat batch can have, a process grew by gigabytes (docs/reliability.md). packed_linear hands it
    a few row counts only (at most 16 per power of two, each at most 1/16 more rows than asked), and
    returns exactly the rows asked for, F.linear's values."""
    from engine.models import fast_paths
    if not fast_paths.packed_weights_work(torch.float32):
        pytest.skip("this torch has no oneDNN fp32 linear")
    assert rows <= fast_paths.padded_rows(rows) <= rows + rows // 16
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    seen = []

    def onednn(x, packed, b):
        seen.append(x.shape[0])
        return real(x, packed, b)
    real, fast_paths._onednn = fast_paths._onednn, onednn
    try:
        y = fast_paths.packed_linear(x, fast_paths.pack(w), b)
    finally:
        fast_paths._onednn = real
    assert seen == [fast_paths.padded_rows(rows)]
    assert y.shape == (rows, 48) and fast_paths.close_to_f_linear(y, x, w, b)


def test_packed_linears_row_counts_are_bounded():
    from engine.models import fast_paths
    sizes = {fast_paths.padded_rows(m) for m in range(1, 8193)}
    assert len(sizes) <= 16 * 13 and all(fast_paths.padded_rows(s) == s for s in sizes)


# ---- the bf16 elementwise chains against models.llama's torch versions ----
def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are, element by element (same sign assumed near 0)."""
    def ordered(t):
        i = t.view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 300), hidden=st.sampled_from([64, 576, 960]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.01, 1.0, 30.0]))
@example(rows=1, hidden=64, seed=7, scale=30.0)     # a gate of about -120: exp overflowed, silu was NaN
def test_fused_bf16_chains_are_torchs_up_to_one_rounding(rows, hidden, seed, scale):
    from engine.models import llama
    g = torch.Generator().manual_seed(seed)
    bf = lambda *shape: (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
    x, res, w = bf(rows, hidden), bf(rows, hidden), bf(hidden)
    checks = [(llama.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))]
    (n1, s1), (n2, s2) = llama.add_rms_norm(x, res, w, 1e-5), ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(s1, s2)                                   # the residual sum is one bf16 add: exact
    checks.append((n1, n2))
    gate_up = bf(rows, 2 * hidden)
    checks.append((llama.silu_and_mul(gate_up, hidden), ops.silu_and_mul(gate_up, hidden)))
    qkv = bf(rows, 5, 64)                                        # q and k heads: a strided view, as in the model
    cos, sin = bf(rows, 1, 64), bf(rows, 1, 64)
    checks.append((llama.apply_rope(qkv[:, :4], cos, sin), ops.rope(qkv[:, :4], cos, sin)))
    for expected, got in checks:
        assert got.shape == expected.shape and got.dtype == torch.bfloat16 and not got.isnan().any()
        tiny = (expected.abs() < 1e-30) & (got.abs() < 1e-30)   # silu far below 0: ~1e-37 against torch's 0
        apart = ulps_apart(expected, got).masked_fill(tiny, 0)
        # an intermediate one bf16 step off (an fp32 exp or rsqrt a bit apart) can move a product by two
        assert apart.max() <= 2, f"{int(apart.max())} bf16 steps apart"
        # nearly all bit for bit; a row's norm is one rsqrt, and where that lands a step apart up to 1.6 %
        # of its values round the other way (3,000 single rows, one CPU), so few rows get more room
        assert (apart > 0).float().mean() < (0.01 if rows >= 16 else 0.03)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), hidden=st.sampled_from([64, 576, 960]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.01, 1.0, 30.0]))
@example(rows=1, hidden=64, seed=7, scale=30.0)     # a gate of about -120: exp's argument is capped
def test_fused_f32_chains_are_torchs_up_to_rounding(rows, hidden, seed, scale):
    from engine.models import llama
    g = torch.Generator().manual_seed(seed)
    f = lambda *shape: torch.randn(*shape, generator=g) * scale
    x, res, w = f(rows, hidden), f(rows, hidden), f(hidden)
    # rounding apart (a fused multiply-add where torch rounds the product; fp32 exp, rsqrt), against the
    # size of what was summed: RoPE's two products can cancel
    close = lambda got, expected: torch.testing.assert_close(  # noqa: E731
        got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    close(ops.rms_norm(x, w, 1e-5), llama.rms_norm(x, w, 1e-5))
    (n1, s1), (n2, s2) = llama.add_rms_norm(x, res, w, 1e-5), ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(s1, s2)                                   # the residual sum is one fp32 add: exact
    close(n2, n1)
    gate_up = f(rows, 2 * hidden)
    close(ops.silu_and_mul(gate_up, hidden), llama.silu_and_mul(gate_up, hidden))
    qkv = f(rows, 5, 64)                                         # q and k heads: a strided view, as in the model
    cos, sin = f(rows, 1, 64), f(rows, 1, 64)
    close(ops.rope(qkv[:, :4], cos, sin), llama.apply_rope(qkv[:, :4], cos, sin))


def test_bf16_and_fp32_take_the_fused_chains_at_every_row_count_other_dtypes_and_eager_do_not(monkeypatch):
    from engine.models.fast_paths import FusedOps
    calls = []
    monkeypatch.setattr(ops, "silu_and_mul", lambda x, inter: calls.append((x.dtype, len(x))) or x[:, :inter])
    fused = FusedOps()
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for rows in (1, 64):
            fused.silu_and_mul(torch.zeros(rows, 8, dtype=dtype), 4)
    assert calls == [(torch.bfloat16, 1), (torch.bfloat16, 64), (torch.float32, 1), (torch.float32, 64)]
    eager = FusedOps(enabled=False)                              # enforce_eager: torch's ops, op by op
    eager.silu_and_mul(torch.zeros(64, 8, dtype=torch.bfloat16), 4)
    assert len(calls) == 4


# ---- bf16 linears on AMX tiles ----
needs_amx = pytest.mark.skipif(not cpu_kernels.amx_bf16(), reason="this CPU (or OS) has no AMX bf16 tiles")


@needs_amx
@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, cpu_kernels.AMX_ROWS), out_blocks=st.integers(1, 40), in_blocks=st.integers(1, 24),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 50.0]))
@example(rows=32, out_blocks=60, in_blocks=18, seed=0, scale=1.0)    # the default model's q/k/v projection
@example(rows=8, out_blocks=36, in_blocks=48, seed=1, scale=1.0)     # its down projection
@example(rows=1, out_blocks=40, in_blocks=1, seed=226, scale=1e-3)   # one row whose sum nearly cancels (below)
def test_amx_linears_compute_what_f_linear_does(rows, out_blocks, in_blocks, seed, scale):
    """Every row count the tile kernel is used for, every column group (full or partial) and input
    length: bit for bit the values of oneDNN's tile kernels behind F.linear. At one row F.linear takes
    another oneDNN kernel, which sums in another order: its fp32 sum may then round differently,
    which shows in bf16 only where the sum nearly cancels (the last example: 1 value of 640)."""
    g = torch.Generator().manual_seed(seed)
    n, k = 16 * out_blocks, 32 * in_blocks
    w = (torch.randn(n, k, generator=g) * scale).to(torch.bfloat16)
    x = (torch.randn(rows, k, generator=g) * scale).to(torch.bfloat16)
    y = ops.linear_amx(x, ops.pack_amx(w), n)
    assert torch.equal(y, reference.linear_tiles(x, w))
    ref = torch.nn.functional.linear(x, w)        # at one row, within a rounding of the fp32 sum of F.linear's
    bound = 1e-5 * (x.float().abs() @ w.float().abs().T) + ref.float().abs() * 2 ** -7
    assert ((y.float() - ref.float()).abs() <= bound).all()


@needs_amx
def test_a_bf16_model_takes_the_amx_linears_for_few_rows_only(monkeypatch):
    from transformers import LlamaConfig

    from engine.models.fast_paths import Linear, amx_linears_work
    from engine.models.llama import LlamaForCausalLM
    assert amx_linears_work()
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg, backend=None).to(torch.bfloat16).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():                                 # built with uninitialised weights
        p.copy_(torch.randn(p.shape, generator=g))
    model.pack_weights()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.amx is not None and m.packed is not None for m in linears)
    assert model.amx_head is not None
    calls = []
    real = ops.linear_amx
    monkeypatch.setattr(ops, "linear_amx", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    lin = linears[0]
    for rows in (1, cpu_kernels.AMX_ROWS, cpu_kernels.AMX_ROWS + 1, 200):
        x = torch.randn(rows, lin.in_features, generator=g).to(torch.bfloat16)
        assert torch.equal(lin(x), reference.linear_tiles(x, lin.weight))
    assert calls == [1, cpu_kernels.AMX_ROWS]                    # more rows: oneDNN's packed kernel
    model.compute_logits(torch.randn(3, 64).to(torch.bfloat16))
    assert calls[-1] == 3


def test_amx_can_be_switched_off_and_fp32_never_takes_it(monkeypatch):
    from transformers import LlamaConfig

    from engine.models.fast_paths import Linear
    from engine.models.llama import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    fp32 = LlamaForCausalLM(cfg, backend=None)
    fp32.pack_weights()
    assert all(m.amx is None for m in fp32.modules() if isinstance(m, Linear)) and fp32.amx_head is None
    monkeypatch.setenv("BATCHSCOPE_AMX", "0")
    cpu_kernels.amx_bf16.cache_clear()
    try:
        assert not cpu_kernels.amx_bf16()
        bf16 = LlamaForCausalLM(cfg, backend=None).to(torch.bfloat16)
        bf16.pack_weights()
        assert all(m.amx is None for m in bf16.modules() if isinstance(m, Linear)) and bf16.amx_head is None
    finally:
        cpu_kernels.amx_bf16.cache_clear()


# ---- fp32 linears of a decode step's few rows (AVX-512, or AVX2 with FMA) ----
needs_f32 = pytest.mark.skipif(not cpu_kernels.f32_linears(),
                               reason="the CPU kernels were built without AVX-512 or AVX2 with FMA")


@needs_f32
@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 300), out_blocks=st.integers(1, 40), k=st.integers(1, 700),
       bias=st.booleans(), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 50.0]))
@example(rows=32, out_blocks=60, k=576, bias=False, seed=0, scale=1.0)     # the default model's q/k/v projection
@example(rows=8, out_blocks=36, k=1536, bias=True, seed=1, scale=1.0)      # its down projection, with a bias
def test_f32_linears_compute_what_f_linear_does_whatever_shares_the_step(rows, out_blocks, k, bias, seed, scale):
    """Every row count the kernel is used for, every group of outputs (full or half) and input length: F.linear's
    values up to summing in another order, and each row's values bit for bit those it has alone."""
    from engine.models.fast_paths import close_to_f_linear
    g = torch.Generator().manual_seed(seed)
    n = 16 * out_blocks
    w, x = torch.randn(n, k, generator=g) * scale, torch.randn(rows, k, generator=g) * scale
    b = torch.randn(n, generator=g) * scale if bias else None
    packed = ops.pack_f32(w)
    y = ops.linear_f32(x, packed, n, b)
    assert close_to_f_linear(y, x, w, b)
    one = int(torch.randint(0, rows, (1,), generator=g))
    assert torch.equal(ops.linear_f32(x[one:one + 1], packed, n, b), y[one:one + 1])


@needs_f32
def test_an_fp32_model_takes_the_f32_linears_where_they_win(monkeypatch):
    """Every row count with AVX-512 (no oneDNN copy beside the kernel's); with AVX2, up to
    F32_AVX2_ROWS rows, oneDNN's packed copy above."""
    from transformers import Qwen2Config

    from engine.models.fast_paths import Linear, close_to_f_linear, f32_linears_work
    from engine.models.llama import LlamaForCausalLM
    assert f32_linears_work()
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)   # q/k/v biases
    model = LlamaForCausalLM(cfg, backend=None).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():                                 # built with uninitialised weights
        p.copy_(torch.randn(p.shape, generator=g))
    model.pack_weights()
    every_row = cpu_kernels.avx512()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.f32 is not None and (m.packed is None) == every_row and m.amx is None for m in linears)
    assert model.f32_head is not None and model.amx_head is None and (model.packed_head is None) == every_row
    calls = []
    real = ops.linear_f32
    monkeypatch.setattr(ops, "linear_f32", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    lin = linears[0]
    assert lin.bias is not None
    sizes = (1, cpu_kernels.F32_AVX2_ROWS, cpu_kernels.F32_AVX2_ROWS + 1, 32, 129, 2048)
    for rows in sizes:
        x = torch.randn(rows, lin.in_features, generator=g)
        assert close_to_f_linear(lin(x), x, lin.weight, lin.bias)
    assert calls == [r for r in sizes if every_row or r <= cpu_kernels.F32_AVX2_ROWS]
    for rows in (3, 40):
        model.compute_logits(torch.randn(rows, 64))
        assert (calls[-1] == rows) == (every_row or rows <= cpu_kernels.F32_AVX2_ROWS)


def test_the_f32_kernel_can_be_switched_off(monkeypatch):
    from transformers import LlamaConfig

    from engine.models.fast_paths import Linear
    from engine.models.llama import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setenv("BATCHSCOPE_F32_KERNEL", "0")
    cpu_kernels.f32_linears.cache_clear()
    try:
        assert not cpu_kernels.f32_linears()
        fp32 = LlamaForCausalLM(cfg, backend=None)
        fp32.pack_weights()
        assert all(m.f32 is None for m in fp32.modules() if isinstance(m, Linear)) and fp32.f32_head is None
    finally:
        cpu_kernels.f32_linears.cache_clear()


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_amx), pytest.param("float32", marks=needs_f32)])
def test_a_decode_steps_layers_in_one_call_compute_what_the_layers_do(monkeypatch, dtype):
    """bf16 on AMX, fp32 on AVX-512: a decode step of few sequences runs its layers in one call of the kernels;
    its hidden states are the layer-by-layer forward's bit for bit, step after step, and the replies the same."""
    from engine import EngineConfig, LLMEngine
    from engine.execution.attention import get_metadata
    from engine.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(dtype=dtype, kv_cache_gb=0.25, enable_prefix_caching=False))
    model = engine.runner.model
    assert model.fused_decode
    forward, compared = model.forward, []

    def both(input_ids, cos, sin):
        one_call = not get_metadata().prefills and input_ids.shape[0] <= model.fused_rows
        model.fused_decode = False
        layered = forward(input_ids, cos, sin)        # each step writes the same keys and values to the same slots
        model.fused_decode = True
        fused = forward(input_ids, cos, sin)
        assert torch.equal(fused, layered)
        compared.append(one_call)
        return fused
    prompts = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3,", "Explain a KV cache."]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    monkeypatch.setattr(model, "forward", both)
    fused_replies = [r["token_ids"] for r in engine.generate(prompts, params)]
    assert sum(compared) >= 10                         # the decode steps took the one call
    monkeypatch.setattr(model, "forward", forward)
    model.fused_decode = False
    assert [r["token_ids"] for r in engine.generate(prompts, params)] == fused_replies
