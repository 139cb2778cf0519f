"""The GPU path, as far as a CPU can check it: CUDA-graph bucketing and padding, backend selection,
the Triton paged-decode kernel (under Triton's interpreter), and the GPU check script in its short mode."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.execution.attention import TorchAttention
from engine.execution.backends import decode_splits, kernel_supports, select_backend
from engine.execution.cuda_graph import bucket_for, token_buckets
from engine.execution.model_runner import StepInputs, token_slots
from tests.helpers import hf_greedy, save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and "triton" not in sys.modules:
    # Triton's interpreter runs kernels on CPU tensors; triton reads this once, when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- buckets, padding and the static-buffer layout (pure functions) ----
def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(3) == [1, 2, 4]
    assert token_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert token_buckets(300) == [1, 2, 4, 8, *range(16, 257, 16), 320]
    assert token_buckets(1024)[-4:] == [832, 896, 960, 1024]
    for m in range(1, 1100, 7):
        sizes = token_buckets(m)
        assert sizes == sorted(set(sizes)) and sizes[-1] >= m and (len(sizes) == 1 or sizes[-2] < m)


@given(st.integers(1, 400), st.integers(1, 64), st.integers(1, 300), st.integers(1, 48))
def test_bucket_choice(num_tokens, num_seqs, max_tokens, max_num_seqs):
    """The smallest bucket that holds the step's tokens and sequences; None (eager) above them all."""
    num_seqs = min(num_seqs, num_tokens)
    sizes = token_buckets(max_tokens)
    t = bucket_for(num_tokens, num_seqs, sizes, max_num_seqs)
    fits = [s for s in sizes if s >= num_tokens and min(s, max_num_seqs) >= num_seqs]
    assert t == (min(fits) if fits else None)
    if num_tokens <= max_tokens and num_seqs <= max_num_seqs:
        assert t is not None and t < 2 * num_tokens + 64          # padding stays bounded


def test_step_layout_pads_and_packs_one_buffer():
    """One flat int64 buffer: token rows, then per-sequence rows, block tables last; a step writes its
    values and pads the rest (scratch slot, empty sequences), and the copy stops after its last table."""
    from engine.execution.cuda_graph import StepLayout
    lay = StepLayout(tokens=16, seqs=4, width=3)
    offs = lay.offsets
    assert [offs[k][1] for k in ("input_ids", "positions", "slots", "sample_rows", "cu_q", "seq_lens")] == \
        [16, 16, 16, 4, 5, 4]
    assert offs["block_tables"] == (61, 12) and lay.size == 73
    ends = [at + n for at, n in offs.values()]
    assert [at for at, _ in offs.values()][1:] == ends[:-1]                  # packed, in order
    host = np.full(lay.size, -1, dtype=np.int64)
    # two decodes and one 4-token chunk (cached prefix of 2) = 6 tokens of a 16-token bucket
    step = StepInputs(input_ids=[5, 6, 1, 2, 3, 4], positions=[9, 20, 2, 3, 4, 5], slots=[41, 100, 66, 67, 68, 69],
                      query_lens=[1, 1, 4], context_lens=[10, 21, 6], block_tables=[[2], [3, 0], [4]],
                      rows=[0, 1, 5], num_decodes=2)
    used = lay.fill(host, step, scratch_slot=800)
    part = {k: host[at:at + n].tolist() for k, (at, n) in offs.items()}
    assert part["input_ids"] == [5, 6, 1, 2, 3, 4] + [0] * 10 and part["positions"][6:] == [0] * 10
    assert part["slots"] == [41, 100, 66, 67, 68, 69] + [800] * 10          # padded tokens: the scratch slot
    assert part["sample_rows"] == [0, 1, 5, 0]                                # a padded sequence samples row 0
    assert part["cu_q"] == [0, 1, 2, 6, 6]                                    # ... and has no tokens
    assert part["seq_lens"] == [10, 21, 6, 0]
    assert part["block_tables"][:3] == [2, -1, -1] and part["block_tables"][3:5] == [3, 0]
    assert used == 61 + 3 * 3                                                 # through the last real table row


@pytest.mark.parametrize("start, end", [(0, 1), (0, 16), (5, 40), (16, 33), (31, 32), (7, 8)])
def test_token_slots(start, end):
    table, bs = [9, 3, 7, 1], 16
    assert token_slots(table, start, end, bs) == [table[p // bs] * bs + p % bs for p in range(start, end)]


def test_unified_launch_shapes():
    """Split-K and tile rows from shapes only: decode-like batches split when few and long; batches
    with chunks take 64-row tiles and no split."""
    from engine.execution.backends import TritonAttention
    pytest.importorskip("triton")
    b = TritonAttention(num_sms=132)
    assert b.launch(4, 4, 2048, 7, 2) == (16, 16)       # four long decodes: 16 ranges each
    assert b.launch(64, 64, 16, 7, 2) == (2, 16)        # 64 decodes at 256 tokens of context
    assert b.launch(288, 33, 64, 7, 2) == (1, 64)       # 32 decodes and a 256-token chunk
    assert b.launch(64, 64, 1, 7, 2) == (1, 16)         # contexts of one block: nothing to split


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
    assert isinstance(select_backend("auto", cpu, 16, 64), TorchAttention)    # the paged decode kernel's class too
    assert select_backend("torch", cpu, 16, 64).name == "torch-sdpa"
    assert select_backend("auto", cpu, 16, 80).name == "torch-sdpa"          # no kernel for head_dim 80
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
    from types import SimpleNamespace

    import engine.execution.backends as backends
    cap = [(8, 9)]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=58))
    installed = {"triton"}                                                    # no flash-attn at first
    monkeypatch.setattr(backends, "_installed", lambda module: module in installed)
    gpu = torch.device("cuda")
    backend = select_backend("auto", gpu, 256, 128)
    assert backend.name == "triton-unified" and backend.graphable and backend.num_sms == 58
    assert select_backend("auto", gpu, 16, 80).name == "torch-sdpa"          # head_dim the kernel cannot tile
    installed.add("flash_attn")
    assert select_backend("auto", gpu, 256, 128).name == "triton-unified"    # every step a graph beats eager flash
    with pytest.raises(ImportError):                                          # (the fake has no real package)
        select_backend("auto", gpu, 256, 80)                                  # head_dim 80: flash-attn's turn
    installed.discard("flash_attn")
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
    """engine.execution.triton_attention, run by the GPU where there is one, else by Triton's interpreter."""
    pytest.importorskip("triton")
    if not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("triton was imported before this module could turn its interpreter on")
    import engine.execution.triton_attention as ta
    return ta


POLICY_RUNS = [("chunked", 32, 3), ("continuous", 32, 3), ("static", 32, 3)]


@pytest.fixture(scope="module")
def qwen2_refs(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    folder = save_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2") / "m")   # head_dim 16
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 77)]
    return folder, prompts, [hf_greedy(ref_model, p, 8, eos=False) for p in prompts]


def run_staggered(eng, prompts, max_tokens: int) -> list[list[int]]:
    """Arrivals one step apart, so steps mix decodes and chunks."""
    pending, rids = list(prompts), []
    while pending or eng.has_unfinished():
        if pending:
            rids.append(eng.add_request(prompt_token_ids=pending.pop(0),
                                        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        eng.step()
    return [eng.get_request(x).output_token_ids for x in rids]


@pytest.mark.parametrize("policy, budget, max_seqs", POLICY_RUNS)
def test_triton_backend_every_step_through_the_graph_buffers(interpreted, qwen2_refs, policy, budget, max_seqs):
    """The whole engine on the Triton backend, every step up to the budget through StepGraphs' static
    buffers and padding (replayed graphs on a GPU, the same region run eagerly on a CPU), larger steps
    eagerly through the same kernel: greedy tokens equal to transformers and to the torch backend."""
    folder, prompts, refs = qwen2_refs
    outs = {}
    for backend in ("triton", "torch"):
        eng = LLMEngine(EngineConfig(model=str(folder), device=DEVICE, dtype="float32", attention_backend=backend,
                                     policy=policy, block_size=16, max_num_batched_tokens=budget,
                                     max_num_seqs=max_seqs, num_kv_blocks=64))
        r = eng.runner
        if backend == "triton":
            tr = r
            assert eng.stats()["attention_backend"] == "triton-unified"
            if not CUDA:   # on a GPU the engine captured real graphs at start-up
                r.graphs = r.make_graphs(budget, max_seqs, capture=False)
                assert eng.stats()["cuda_graphs"] == {"token_buckets": token_buckets(budget), "max_seqs": max_seqs,
                                                      "captured": 0, "capture_seconds": 0.0, "memory_bytes": 0}
            used, eager = [], []
            run, upload = r.graphs.run, r.upload
            r.graphs.run = lambda step, t: used.append((len(step.input_ids), len(step.query_lens), t)) or run(step, t)
            r.upload = lambda step: eager.append(len(step.input_ids)) or upload(step)
        outs[backend] = run_staggered(eng, prompts, 8)
    assert outs["triton"] == refs and outs["torch"] == refs
    assert all(t in tr.graphs.sizes and n <= t for n, _, t in used)
    assert any(n < t for n, _, t in used)                             # some steps ran padded
    if policy == "chunked":
        assert any(s > 1 and n > s for n, s, _ in used)               # mixed steps (decodes and a chunk) too
        assert not eager                                              # every step a graph
    else:
        assert eager and min(eager) > budget                          # whole prompts over the budget: eager
    assert tr.kv_cache.shape[2] == tr.num_blocks + 1                  # the scratch block is outside the pool


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
    ms = eng["mixed_step"]["eager"]                      # no graphs on a CPU: the eager row only
    assert ms["steps"] == 3 and ms["model_step_ms"] > 0 and ms["engine_step_ms"] >= ms["model_step_ms"]
    rows = res["targets"]                                 # every target row of docs/gpu.md, measured or not
    assert len(rows) == 9 and rows["mixed_model_step_ms (32 decodes@1024 + 256 chunk)"]["value"] is None
    assert rows["fp32_greedy_prompts_equal"]["pass"] and rows["vs_static_generate"]["value"] > 0


@pytest.mark.server
def test_gpu_live_check_quick(tmp_path):
    """The live-server check end to end on a CPU: the server, the openai client's streaming chats and the
    long documents under both policies, the records from /ws/steps, the ratios from app/readers/metrics.py."""
    out = tmp_path / "live.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_live_check.py"), "--quick", "--device", "cpu",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["healthz"]["status"] == "ok"
    for policy in ("chunked", "continuous"):
        r = res[policy]
        assert not r["errors"] and r["steps"] > 0 and r["chat_tbt_p99_ms"] > 0, r
    assert res["continuous"]["stall_count"] > 0                  # whole documents stall the chats ...
    assert res["targets"]["chunked_stall_free"], res["chunked"]  # ... and chunked steps never leave one out
    # (the TBT ratio is a speed figure, printed by the script: a timed assertion here fails on a busy machine)
    assert res["targets"]["chat_tbt_p99_continuous_over_chunked"] > 0


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
    from engine.models.fast_paths import FusedOps
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


def test_fused_dispatch_and_fallback(monkeypatch):
    """CPU fp16 tensors (no C++ chain) take the plain function; on CUDA a first compile that fails leaves it unfused."""
    from types import SimpleNamespace

    from engine.models.fast_paths import Fused

    def FuseOnCuda(fn):
        return Fused(fn, "rms_norm")

    def failing_compile(fn, **kw):
        def compiled(*args):
            raise RuntimeError("no compiler here")
        return compiled
    monkeypatch.setattr(torch, "compile", failing_compile)
    f = FuseOnCuda(lambda x, y: y + 1)
    f.active = True                                                  # as inside FusedOps.fusing()
    assert f(torch.zeros(1, dtype=torch.float16), 1) == 2 and f.compiled is None   # CPU: never compiled
    on_gpu = SimpleNamespace(is_cuda=True)
    assert f(on_gpu, 1) == 2 and f.compiled is f.fn                  # the compile failed: plain from now on
    assert f(on_gpu, 2) == 3
    g = FuseOnCuda(lambda x, y: y + 1)                               # outside fusing(): plain, never compiled
    assert g(on_gpu, 1) == 2 and g.compiled is None


def test_fusing_is_on_only_inside_the_block():
    from engine.models.fast_paths import FusedOps
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
    from app.readers.analysis import fit_stream
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
    (engine/, app.readers.analysis, app.replay.scenarios' data) must not pull the web stack in."""
    code = ("import sys, runpy; sys.argv = ['x', '--help']\n"
            "for s in ('scripts/gpu_cost_trace.py', 'scripts/gpu_check.py'):\n"
            "    try:\n        runpy.run_path(s, run_name='__main__')\n    except SystemExit:\n        pass\n"
            "bad = {'gradio', 'fastapi', 'uvicorn'} & set(sys.modules)\n"
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
