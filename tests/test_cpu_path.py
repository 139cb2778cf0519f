"""The CPU path: grouped decode attention, the rope roll, int8 linears and their cache,
per-model fusion switches, and a failed request's blocks."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.execution.attention import AttentionMetadata, TorchAttention, decode_groups
from tests.helpers import save_tiny_model

BS, KV, HD, HEADS = 4, 2, 8, 6


# ---- decode attention: grouped, gathered calls == attention token by token ----
@settings(max_examples=80, deadline=None)
@given(st.data())
def test_grouped_decode_matches_attention_token_by_token(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    num_blocks = 60
    k_cache, v_cache = (torch.randn(num_blocks, BS, KV, HD, generator=g),
                        torch.randn(num_blocks, BS, KV, HD, generator=g))
    ctxs = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))   # lengths far apart: several groups
    free = list(range(num_blocks))
    if data.draw(st.booleans()):                        # fragmented tables
        free = data.draw(st.permutations(free))
    tables = []
    for c in ctxs:
        n = -(-c // BS) + data.draw(st.integers(0, 1))  # sometimes a block beyond the context
        tables.append(free[:n])
        free = free[n:]
    width = max(map(len, tables)) + data.draw(st.integers(0, 2))   # rows padded as the runner pads them
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), context_lens=torch.tensor(ctxs),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             num_decodes=len(ctxs), decode_ctx=ctxs)
    q = torch.randn(len(ctxs), HEADS, HD, generator=g)
    out = TorchAttention().decode(q, k_cache, v_cache, meta)
    for i, c in enumerate(ctxs):
        keys = k_cache[tables[i]].flatten(0, 1)[:c].repeat_interleave(HEADS // KV, 1)   # (c, heads, hd)
        vals = v_cache[tables[i]].flatten(0, 1)[:c].repeat_interleave(HEADS // KV, 1)
        w = torch.softmax(torch.einsum("hd,chd->hc", q[i], keys) / HD ** 0.5, -1)
        torch.testing.assert_close(out[i], torch.einsum("hc,chd->hd", w, vals), rtol=1e-4, atol=1e-5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=40))
def test_decode_groups_cover_each_decode_once_within_twice_its_blocks(blocks):
    groups = decode_groups(blocks)
    assert sorted(i for grp in groups for i in grp) == list(range(len(blocks)))
    for grp in groups:
        assert all(2 * blocks[i] >= blocks[grp[0]] and blocks[i] <= blocks[grp[0]] for i in grp)
    assert len(groups) <= max(blocks).bit_length()     # at most one group per halving of the length


# ---- rope by roll with a sign-folded sin table == rotate_half ----
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), heads=st.integers(1, 5), half=st.integers(1, 16), seed=st.integers(0, 999))
def test_rope_roll_equals_rotate_half(n, heads, half, seed):
    from engine.models.llama import apply_rope
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, 2 * half, generator=g)
    ang = torch.randn(n, 1, half, generator=g)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    ref = x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
    signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)
    assert torch.equal(apply_rope(x, cos, signed), ref)


# ---- int8 ----
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 40), seed=st.integers(0, 999), spread=st.floats(1e-3, 1e3))
def test_quantize_per_channel_error_is_half_a_step(rows, cols, seed, spread):
    from engine.weights.quant import quantize_per_channel
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * spread
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6 * spread).all()


int8 = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm here")


@int8
def test_int8_linear_close_to_fp32():
    from engine.weights.quant import Int8Linear, quantize_per_channel
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 64, generator=g), torch.randn(48, generator=g), torch.randn(5, 64, generator=g)
    lin = Int8Linear(*quantize_per_channel(w), b)
    ref = torch.nn.functional.linear(x, w, b)
    assert (lin(x) - ref).abs().max() < 0.05 * ref.abs().max()
    assert lin.nbytes == 48 * 64 + 48 * 4 * 2


@settings(max_examples=6, deadline=None)
@given(arch=st.sampled_from(["llama", "qwen2", "llama-tied-scaled"]), seed=st.integers(0, 999),
       outlier=st.floats(1.0, 1e3))
def test_smoothing_leaves_the_model_unchanged(tmp_path_factory, arch, seed, outlier):
    """Dividing each linear's input channels by s where they are made (a norm's weight; for o_proj the v
    rows of qkv_proj, shared by a group of heads) and multiplying its weight columns by s is exact in
    real numbers: without the int8 rounding the model's logits stay those of fp32, for any maxima."""
    from engine.weights.quant import smooth, smoothed
    folder = save_tiny_model(arch, tmp_path_factory.mktemp(arch))
    eng = LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=8, num_kv_blocks=32))
    model = eng.runner.model
    ids = list(range(200, 240))
    before = _prefill_logits(eng, ids)
    g = torch.Generator().manual_seed(seed)
    amax = {name: torch.rand(model.cfg.hidden_size if name == "head" else model.get_submodule(name).in_features,
                             generator=g) + 0.01 for _, name in smoothed(model)}
    for a in amax.values():
        a[torch.randint(0, a.numel(), (2,), generator=g)] *= outlier       # a few large channels
    weights, biases, norms = smooth(model, amax)
    if model.tie_word_embeddings:           # the head is the embedding table: leave both it and its norm fp32
        del norms["norm"], weights["head"]
    with torch.no_grad():
        for norm, w in norms.items():
            model.get_submodule(norm).weight.copy_(w)
        for name, w in weights.items():
            lin = model.lm_head if name == "head" else model.get_submodule(name)
            lin.weight.copy_(w)
            if biases[name] is not None:
                lin.bias.copy_(biases[name])
    model.pack_weights()                    # the kernels' copies of the weights, made again from the new ones
    after = _prefill_logits(eng, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * before.abs().max().item())


def _prefill_logits(eng, ids):
    from engine.execution.attention import set_metadata
    from engine.scheduling.scheduler import Batch
    from engine.scheduling.sequence import Sequence
    runner = eng.runner
    seq = Sequence("s", "s", ids, SamplingParams(max_tokens=1), 0.0)
    assert eng.block_manager.allocate(seq, len(ids))
    with torch.inference_mode():
        input_ids, positions, _, meta = runner.upload(runner.prepare(Batch(items=[(seq, len(ids))])))
        set_metadata(meta)
        hidden = runner.model(input_ids, runner.cos[positions].unsqueeze(1), runner.sin[positions].unsqueeze(1))
        set_metadata(None)
        logits = runner.model.compute_logits(hidden)
    eng.block_manager.free(seq)
    return logits


def _greedy(eng, prompts, n=8):
    rids = [eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [eng.get_request(r).output_token_ids for r in rids]


@int8
def test_int8_engine_caches_its_weights_and_rebuilds_them_for_new_ones(tmp_path):
    from engine.weights.quant import INT8_FILE, Int8Linear
    folder = save_tiny_model("llama", tmp_path / "llama")
    kw = dict(model=str(folder), dtype="int8", block_size=8, num_kv_blocks=64)
    prompts = [list(range(100, 100 + n)) for n in (3, 40, 70)]
    eng = LLMEngine(EngineConfig(**kw))
    assert (folder / INT8_FILE).exists()
    assert isinstance(eng.runner.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert isinstance(eng.runner.model.layers[0].self_attn.o_proj, Int8Linear)         # smoothed through v
    assert isinstance(eng.runner.model.layers[0].mlp.down_proj, torch.nn.Linear)      # reads no norm: fp32
    fp32 = LLMEngine(EngineConfig(**{**kw, "dtype": "float32"}))
    assert eng.runner.weight_bytes < 0.6 * fp32.runner.weight_bytes
    first = _greedy(eng, prompts)
    made = (folder / INT8_FILE).stat().st_mtime_ns
    assert _greedy(LLMEngine(EngineConfig(**kw)), prompts) == first                  # read back: same model
    assert (folder / INT8_FILE).stat().st_mtime_ns == made
    os.utime(folder / "model.safetensors", ns=(made + 10**9, made + 10**9))          # "new" fp32 weights
    LLMEngine(EngineConfig(**kw))
    assert (folder / INT8_FILE).stat().st_mtime_ns != made


def test_int8_needs_a_cpu(tmp_path):
    from transformers import AutoConfig

    from engine.weights.loader import load_model
    folder = save_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="int8"):
        load_model(folder, AutoConfig.from_pretrained(folder), "int8", torch.device("meta"), TorchAttention())


# ---- fusion switch per model ----
def test_fusion_switch_is_per_model(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "llama")
    eager = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=16, enforce_eager=True))
    fused = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=16))
    ops = [e.runner.model.layers[0].self_attn.ops for e in (eager, fused)]
    assert ops[0] is not ops[1]
    assert not ops[0].rms_norm.enabled and ops[1].rms_norm.enabled      # building the second left the first alone


# ---- linears cut by output features, one slice per thread == F.linear ----
@settings(max_examples=60, deadline=None)
@given(rows=st.sampled_from([0, 1, 2, 5, 9, 257]), cols=st.integers(1, 24), out=st.integers(1, 24),
       threads=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 999))
def test_split_linear_equals_f_linear(rows, cols, out, threads, bias, seed):
    from engine.models.fast_paths import linear
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, cols, generator=g), torch.randn(out, cols, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


# ---- a request whose KV went non-finite leaves nothing behind for the next owner of its blocks ----
def test_a_failed_requests_non_finite_kv_does_not_reach_the_next_owner_of_its_blocks(tmp_path):
    """Decodes attend over padded, masked blocks, and a masked NaN still poisons softmax(scores) @ V.
    A request whose activations went NaN fails (non-finite logits); the blocks it leaves must not make
    the next request that gets them fail too."""
    folder = save_tiny_model("llama", tmp_path / "m")
    poison = 777
    kw = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=4)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    ids = [300 + i for i in range(7)]                     # 7 + 5 tokens: its last block is never full at a decode
    want = LLMEngine(EngineConfig(**kw)).generate([ids], params)[0]["token_ids"]
    eng = LLMEngine(EngineConfig(**kw))
    eng.runner.model.embed_tokens.register_forward_hook(
        lambda mod, inp, out: out.masked_fill((inp[0] == poison)[:, None], float("nan")))
    bad = eng.generate([[300, poison] + list(range(400, 408))], params)[0]    # 10 tokens: 3 of the 4 blocks
    assert bad["finish_reason"] == "error" and "non-finite" in bad["error"]
    good = eng.generate([ids], params)[0]
    assert good["error"] is None and good["token_ids"] == want
    assert eng.block_manager.num_used == 0


def test_the_cpu_kernels_build_where_a_compiler_is():
    """tests/test_cpu_kernels.py skips itself where the library did not build; a compiler that is there and
    a source that does not compile must fail here instead, and a CPU with AVX-512 (or AVX2 and FMA) must get its
    fp32 linears' kernel, and one with AVX-512 its causal prefill kernel too."""
    from engine.kernels import cpu_kernels
    if cpu_kernels.compiler() is None or os.environ.get("BATCHSCOPE_CPU_KERNEL") == "0":
        pytest.skip("no C++ compiler here (or the kernels are switched off)")
    assert cpu_kernels.library() is not None, "engine/kernels/cpu_kernels.cpp did not build: see the warning logged"
    flags, arch = set(cpu_kernels.cpu_flags().split()), os.environ.get("BATCHSCOPE_CPU_ARCH", "native")
    if ({"avx2", "fma"} <= flags or "avx512f" in flags) and os.environ.get("BATCHSCOPE_F32_KERNEL") != "0":
        assert cpu_kernels.f32_linears()
    if "avx512f" in flags and arch == "native":
        assert cpu_kernels.avx512()
