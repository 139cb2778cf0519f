"""The GPU path, as far as a CPU can check it: CUDA-graph bucketing and padding, backend selection,
the Triton paged-decode kernel (under Triton's interpreter), and the GPU check script in its short mode."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention import TorchAttention, decode_splits, kernel_supports, select_backend
from engine.cuda_graph import DecodeGraphs, bucket_for, graph_batch_sizes, pad_decodes
from engine.model_runner import StepInputs, token_slots
from tests.helpers import hf_greedy, save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and "triton" not in sys.modules:
    # Triton's interpreter runs kernels on CPU tensors; triton reads this once, when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- bucketing and padding (pure functions) ----
@pytest.mark.parametrize("max_num_seqs, sizes", [(1, [1]), (3, [1, 2, 4]), (16, [1, 2, 4, 8, 16]),
                                                 (20, [1, 2, 4, 8, 16, 32]), (64, [1, 2, 4, 8, 16, 32, 48, 64])])
def test_graph_batch_sizes(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes
    for n in range(1, max_num_seqs + 1):
        b = bucket_for(n, sizes)
        assert b >= n and all(s < n for s in sizes if s < b)
    assert bucket_for(sizes[-1] + 1, sizes) is None   # larger batches run eagerly


def test_pad_decodes_targets_the_scratch_block():
    step = StepInputs(input_ids=[5, 6, 7], positions=[9, 20, 3], slots=[41, 100, 67], query_lens=[1, 1, 1],
                      context_lens=[10, 21, 4], block_tables=[[2, 1], [3, 0], [4]], rows=[0, 1, 2], num_decodes=3)
    pad_decodes(step, 8, scratch_block=50, block_size=16)
    assert step.input_ids == [5, 6, 7] + [0] * 5 and step.positions == [9, 20, 3] + [0] * 5
    assert step.slots[3:] == [50 * 16] * 5 and step.context_lens[3:] == [1] * 5
    assert step.block_tables[3:] == [[50]] * 5 and step.num_decodes == 8
    assert step.rows == [0, 1, 2]                       # padded rows are never sampled


@pytest.mark.parametrize("start, end", [(0, 1), (0, 16), (5, 40), (16, 33), (31, 32), (7, 8)])
def test_token_slots(start, end):
    table, bs = [9, 3, 7, 1], 16
    assert token_slots(table, start, end, bs) == [table[p // bs] * bs + p % bs for p in range(start, end)]


def test_decode_splits():
    assert decode_splits(64, 8, 16, 108) == 1           # enough programs already: no split
    assert decode_splits(64, 2, 16, 108) == 2           # 128 programs on 108 SMs: two ranges each
    assert decode_splits(1, 2, 256, 108) == 16          # one long sequence: capped at 16 ranges
    assert decode_splits(1, 2, 20, 108) == 2            # at least 8 blocks per range
    assert decode_splits(4, 8, 4096, 132) == 9


# ---- backend selection ----
def test_backend_selection_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu, 16, 64), TorchAttention)
    assert select_backend("auto", cpu, 16, 64).name == "torch-sdpa"
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", cpu, 256, 64)
    with pytest.raises(ValueError, match="triton"):
        select_backend("triton", cpu, 16, 64)
    assert kernel_supports(16, 64) and kernel_supports(32, 128) and kernel_supports(8, 64) and kernel_supports(256, 64)
    assert not kernel_supports(16, 80) and not kernel_supports(24, 64) and not kernel_supports(16, 8)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="xformers")
    assert EngineConfig(device="cpu").torch_dtype in (torch.float32, torch.bfloat16)


def test_backend_selection_on_cuda(interpreted, monkeypatch):
    """The CUDA branch of the choice, with the device's answers faked (the kernel module is loaded
    first, by the fixture, so that dropping TRITON_INTERPRET here does not change how it runs later)."""
    import engine.attention as attention
    from types import SimpleNamespace
    cap = [(8, 9)]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(multi_processor_count=58))
    monkeypatch.setattr(attention, "_installed", lambda module: module == "triton")   # no flash-attn
    gpu = torch.device("cuda")
    backend = select_backend("auto", gpu, 256, 128)
    assert backend.name == "triton-paged" and backend.graphable and backend.num_sms == 58
    assert select_backend("auto", gpu, 16, 80).name == "torch-sdpa"          # head_dim the kernel cannot tile
    assert select_backend("torch", gpu, 16, 64).name == "torch-sdpa"
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", gpu, 16, 64)                             # block size 16: flash-attn 2 cannot
    cap[0] = (7, 5)                                                           # a T4: no Triton backend
    assert select_backend("auto", gpu, 16, 64).name == "torch-sdpa"
    with pytest.raises(ValueError, match="capability"):
        select_backend("triton", gpu, 16, 64)


# ---- the Triton kernel, run by Triton's interpreter on CPU tensors ----
@pytest.fixture(scope="module")
def interpreted():
    """engine.triton_attention, run by the GPU where there is one, else by Triton's interpreter."""
    pytest.importorskip("triton")
    if not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("triton was imported before this module could turn its interpreter on")
    import engine.triton_attention as ta
    return ta


def reference_decode(q, k_cache, v_cache, tables, ctx):
    """fp64 attention of each query row over its first ctx tokens, K/V heads repeated for GQA."""
    out = []
    group = q.shape[1] // k_cache.shape[2]
    for i in range(q.shape[0]):
        c = int(ctx[i])
        k = k_cache[tables[i]].flatten(0, 1)[:c].double().repeat_interleave(group, 1)
        v = v_cache[tables[i]].flatten(0, 1)[:c].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,thd->ht", q[i].double(), k) * q.shape[-1] ** -0.5
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(14, 2, 64, 16), (4, 4, 32, 16), (12, 2, 128, 32), (8, 2, 64, 8), (8, 2, 32, 256)])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_kernel(interpreted, dtype, heads, kv_heads, head_dim, block_size, splits):
    g = torch.Generator().manual_seed(heads * 7 + splits)
    k_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=g).to(dtype)
    ctx = torch.tensor([1, 5, block_size, block_size + 1, 100, 3 * block_size + 2])
    width = -(-int(ctx.max()) // block_size)
    tables = torch.stack([torch.randperm(40, generator=g)[:width] for _ in ctx])
    q = torch.randn(len(ctx), heads, head_dim, generator=g).to(dtype)
    out = interpreted.paged_decode(*(x.to(DEVICE) for x in (q, k_cache, v_cache, tables, ctx)), splits).cpu()
    ref = reference_decode(q, k_cache, v_cache, tables, ctx)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert out.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 1e-2), err


AOT_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from engine.triton_attention import _paged_decode_kernel
ints = ["num_splits", "stride_qs", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_bt", "stride_os",
        "stride_oh", "stride_osp"]
for dtype, split, group, head_dim in [("bf16", False, 7, 64), ("bf16", True, 6, 128), ("fp32", False, 4, 64)]:
    sig = {"out_ptr": "*fp32" if split else "*" + dtype, "lse_ptr": "*fp32", "q_ptr": "*" + dtype,
           "k_cache_ptr": "*" + dtype, "v_cache_ptr": "*" + dtype, "block_tables_ptr": "*i64",
           "context_lens_ptr": "*i64", "scale": "fp32", **{k: "i32" for k in ints}}
    consts = dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=head_dim, BLOCK_SIZE=16, TILE=2048 // head_dim, SPLIT=split,
                  PRECISION="ieee" if dtype == "fp32" else "tf32")
    sig.update({k: "constexpr" for k in consts})
    src = triton.compiler.ASTSource(fn=_paged_decode_kernel, signature=sig, constexprs=consts)
    assert triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32)).asm["cubin"]
"""


@pytest.mark.parametrize("capability", [80, 89, 90])   # A100; L4 and L40S; H100
def test_paged_decode_kernel_compiles_for_gpus(capability):
    """Compiled ahead of time to machine code by the ptxas that ships in the triton wheel: no GPU needed.
    In a fresh process, since the interpreter (on in this one) replaces the compiler's front end."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT_COMPILE, str(capability)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_triton_backend_and_graph_buffers_match_transformers(interpreted, tmp_path):
    """The whole engine on the Triton backend, decode steps through DecodeGraphs' static buffers and
    padding (replayed graphs on a GPU, the same region run eagerly on a CPU), greedy tokens equal to
    transformers."""
    from transformers import AutoModelForCausalLM
    folder = save_tiny_model("qwen2", tmp_path / "qwen2")   # head_dim 16
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 77)]
    refs = [hf_greedy(ref_model, p, 10, eos=False) for p in prompts]
    eng = LLMEngine(EngineConfig(model=str(folder), device=DEVICE, dtype="float32", attention_backend="triton",
                                 block_size=16, max_num_batched_tokens=32, max_num_seqs=3, num_kv_blocks=64))
    assert eng.stats()["attention_backend"] == "triton-paged"
    r = eng.runner
    if not CUDA:   # on a GPU the engine captured real graphs at start-up
        r.graphs = DecodeGraphs(r.model, r.cos, r.sin, 3, r.max_blocks_per_seq, r.scratch_block, r.block_size,
                                capture=False)
    sizes = []
    run = r.graphs.run
    r.graphs.run = lambda ids, *a: sizes.append(len(ids)) or run(ids, *a)
    rids = [eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=10, ignore_eos=True))
            for p in prompts]
    while eng.has_unfinished():
        eng.step()
    assert [eng.get_request(x).output_token_ids for x in rids] == refs
    assert 4 in sizes and set(sizes) <= {1, 2, 4}          # three decodes ran padded to the bucket of 4
    assert r.kv_cache.shape[2] == r.num_blocks + 1         # the scratch block is outside the block manager's pool


# ---- the GPU check script, short mode, on CPU ----
def test_gpu_check_quick(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--quick", "--device", "cpu",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["models"]["tiny"]
    for section in ("equality", "baselines", "engine"):
        assert "error" not in res[section], res[section]
    assert res["equality"]["equal"] == res["equality"]["prompts"]
    eng = res["engine"]
    assert eng["mixed"]["output_tokens_per_s"] > 0 and eng["decode"]["step_ms_eager"] > 0
    assert set(eng["long_prompt"]) == {"chunked", "continuous"}
    assert res["baselines"]["static_generate"]["output_tokens_per_s"] > 0
    assert {"vs_static_generate", "fp32_greedy_prompts_equal", "long_prompt_p99_tbt_continuous_over_chunked"} \
        <= set(res["targets"])


def test_kv_sizing_after_warmup(tmp_path, monkeypatch):
    """The CUDA start-up path on a CPU, with torch.cuda's memory statistics faked: the warm-up runs the
    largest possible step (here a budget over the context length: two prompts) and the cache gets
    what its peak leaves."""
    folder = save_tiny_model("llama", tmp_path / "llama")
    eng = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=16,
                                 max_num_batched_tokens=300, max_model_len=256, num_kv_blocks=8))
    r = eng.runner
    peak = {}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: peak.setdefault("v", r.kv_cache.numel() * 4 + r.weight_bytes + 10**6))
    ran = []
    run = r.run
    monkeypatch.setattr(r, "run", lambda batch: ran.append([n for _, n in batch.items]) or run(batch))
    free = 2**30
    blocks = r._blocks_left_after_warmup(eng.config, free)
    assert ran == [[256, 44]]                             # 300 tokens, no prompt over the context length
    expected = int((free * 0.85 - r.weight_bytes - 10**6) // r.bytes_per_block) - 1
    assert blocks == expected and r.kv_cache is None


def test_fused_elementwise_chains_trace_with_dynamic_shapes():
    """On CUDA these run through torch.compile (one kernel each); here: they trace with dynamic shapes,
    including the one-token case, and the traced graph computes exactly what the eager function does.
    On a CPU the engine itself never compiles them."""
    from engine.models.llama import FusedOps
    ops = FusedOps()
    rms_norm, add_rms_norm, apply_rope, silu_and_mul = ops.rms_norm, ops.add_rms_norm, ops.apply_rope, ops.silu_and_mul
    torch._dynamo.reset()
    traced = {f: torch.compile(f.fn, dynamic=True, backend="aot_eager")
              for f in (rms_norm, add_rms_norm, apply_rope, silu_and_mul)}
    g = torch.Generator().manual_seed(0)
    for n in (64, 7, 1, 33):
        x, r, w = (torch.randn(n, 96, generator=g) for _ in range(3))
        qk = torch.randn(n, 8, 16, generator=g)
        cos, sin = torch.randn(n, 1, 16, generator=g), torch.randn(n, 1, 16, generator=g)
        for f, args in [(rms_norm, (x, w[0], 1e-6)), (add_rms_norm, (x, r, w[0], 1e-6)),
                        (apply_rope, (qk, cos, sin)), (silu_and_mul, (x, 48))]:
            got, want = traced[f](*args), f.fn(*args)
            for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
                assert torch.equal(a, b), (f.fn.__name__, n)
    assert all(f.compiled is None for f in traced)       # CPU tensors never compile them


def test_fuse_on_cuda_dispatch_and_fallback(monkeypatch):
    """CPU tensors take the plain function; on CUDA a first compile that fails leaves it unfused."""
    from types import SimpleNamespace
    from engine.models.llama import FuseOnCuda

    def failing_compile(fn, **kw):
        def compiled(*args):
            raise RuntimeError("no compiler here")
        return compiled
    monkeypatch.setattr(torch, "compile", failing_compile)
    f = FuseOnCuda(lambda x, y: y + 1)
    f.active = True                                                  # as inside FusedOps.fusing()
    assert f(torch.zeros(1), 1) == 2 and f.compiled is None          # CPU: never compiled
    on_gpu = SimpleNamespace(is_cuda=True)
    assert f(on_gpu, 1) == 2 and f.compiled is f.fn                  # the compile failed: plain from now on
    assert f(on_gpu, 2) == 3
    g = FuseOnCuda(lambda x, y: y + 1)                               # outside fusing(): plain, never compiled
    assert g(on_gpu, 1) == 2 and g.compiled is None


def test_fusing_is_on_only_inside_the_block():
    from engine.models.llama import FusedOps
    ops = FusedOps()
    chains = (ops.rms_norm, ops.add_rms_norm, ops.apply_rope, ops.silu_and_mul)
    with pytest.raises(RuntimeError):
        with ops.fusing():
            assert all(f.active for f in chains)
            raise RuntimeError("a failed capture")
    assert not any(f.active for f in chains)


# ---- the GPU cost-trace recorder, short mode, on CPU ----
def test_gpu_cost_trace_quick(tmp_path):
    """The recorder runs end to end and writes a trace the cost model reads: a header naming what
    produced it, and step records of every phase's shape (decode-only, prefill-only, mixed)."""
    from app.analysis import fit_stream
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_cost_trace.py"), "--quick", "--device", "cpu",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    objs = json.loads(out.read_text())
    assert objs[0]["type"] == "trace" and objs[0]["scenario"] == "gpu-cost-sweep"
    steps = [o for o in objs if o["type"] == "step"]
    kinds = {frozenset(it["kind"] for it in s["items"]) for s in steps}
    assert {frozenset({"decode"}), frozenset({"prefill"}), frozenset({"decode", "prefill"})} <= kinds
    assert not any("kv_map" in s or "kv_ops" in s for s in steps)
    assert [f.device for f in fit_stream(objs)] == ["cpu/float32"]


def test_gpu_scripts_import_without_the_web_stack():
    """A GPU machine may have torch and transformers but no gradio or fastapi: the scripts' imports
    (engine/, app.analysis, app.scenarios' data) must not pull the web stack in."""
    code = ("import sys, runpy; sys.argv = ['x', '--help']\n"
            "for s in ('scripts/gpu_cost_trace.py', 'scripts/gpu_check.py'):\n"
            "    try:\n        runpy.run_path(s, run_name='__main__')\n    except SystemExit:\n        pass\n"
            "bad = {'gradio', 'fastapi', 'uvicorn'} & set(sys.modules)\n"
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
