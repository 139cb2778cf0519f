"""The CPU kernels as checked ops: every op against its torch reference on random shapes and every broken
argument refused by name (tests/kernel_fuzz.py, in a child process, so a crash fails the test), the same
fuzz under AddressSanitizer, the child-process probe of a new build, one OpenMP runtime in the process, and
a non-finite value caught with the kernels on."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import build, cpu_kernels, ops

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler: the kernels cannot be built")
ROOT = Path(__file__).resolve().parent.parent


def run_fuzz(kind: str, examples: int, **env) -> None:
    r = subprocess.run([sys.executable, "-m", "tests.kernel_fuzz", kind, str(examples)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, **env})
    if r.returncode < 0:
        pytest.fail(f"the {kind} fuzz crashed with {signal.Signals(-r.returncode).name}:\n{r.stderr[-3000:]}")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"the {kind} fuzz failed:\n{r.stderr[-4000:]}"


def test_every_op_matches_its_torch_reference_on_random_shapes():
    run_fuzz("valid", 300)


def test_every_broken_argument_is_refused_by_name_and_nothing_is_written():
    run_fuzz("invalid", 300)


def test_the_fuzz_runs_clean_under_address_sanitizer():
    """The same fuzz against a build with -fsanitize=address (docs/results.md has the command): an access
    past any tensor's memory, read or write, ends the child with ASan's report."""
    asan, stdcxx = (subprocess.run(["g++", f"-print-file-name={n}"], capture_output=True, text=True).stdout.strip()
                    for n in ("libasan.so", "libstdc++.so"))
    if not os.path.isabs(asan) or cpu_kernels.compiler() is None:
        pytest.skip("no AddressSanitizer runtime here")
    from engine.config import cache_dir
    path = build.library_path(cpu_kernels.compiler(), cpu_kernels.cpu_flags(), cache_dir(), sanitize=True)
    if not path.exists():
        build.build(cpu_kernels.compiler(), path, sanitize=True)
    # libstdc++ beside libasan: python itself does not link it, and ASan must see its __cxa_throw
    env = dict(LD_PRELOAD=f"{asan} {stdcxx}", ASAN_OPTIONS="detect_leaks=0", BATCHSCOPE_CPU_KERNEL_PATH=str(path))
    run_fuzz("valid,invalid", 100, **env)


@pytest.mark.skipif(not {"avx512f", "avx2", "fma"} <= set(cpu_kernels.cpu_flags().split()),
                    reason="the AVX2 build is the native one here (or this CPU has not AVX2): the other tests run it")
def test_the_avx2_build_passes_the_fuzz_on_a_cpu_with_avx512():
    """What a CPU with AVX2 and FMA but no AVX-512 runs (the fp32 linears' 8-wide form, no causal kernel), built
    with -march=x86-64-v3 and fuzzed here, so a CPU with AVX-512 tests it too."""
    env = dict(BATCHSCOPE_CPU_ARCH="x86-64-v3")
    r = subprocess.run([sys.executable, "-c", "from engine.kernels import cpu_kernels as k; "
                        "print(k.library() is not None, k.f32_kernel(), k.avx512())"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, **env})
    assert r.stdout.split() == ["True", "True", "False"], r.stderr[-2000:]
    run_fuzz("valid,invalid", 100, **env)


def test_the_registered_torch_ops_run_the_checked_bodies_the_core_calls():
    """The core calls each op's body as a Python function (no dispatcher); torch.ops.batchscope.<name> is the
    same body: the same values, the same refusal by name, nothing written on a refusal."""
    x, w = torch.randn(3, 40), torch.randn(40)
    assert torch.equal(torch.ops.batchscope.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    k_cache = torch.zeros(4, 16, 2, 64)
    v_cache, key = torch.zeros_like(k_cache), torch.randn(2, 2, 64)
    for call in (torch.ops.batchscope.rms_norm, ops.rms_norm):
        with pytest.raises(ValueError, match="^weight: "):
            call(x, torch.randn(41), 1e-5)
    for call in (torch.ops.batchscope.write_kv, ops.write_kv):
        with pytest.raises(ValueError, match="^slot_mapping: holds 64, outside"):
            call(key, key, k_cache, v_cache, torch.tensor([3, 64]))
    assert not k_cache.any() and not v_cache.any()
    torch.ops.batchscope.write_kv(key, key, k_cache, v_cache, torch.tensor([3, 63]))
    written = k_cache.clone()
    k_cache.zero_()
    ops.write_kv(key, key, k_cache, v_cache, torch.tensor([3, 63]))
    assert torch.equal(k_cache, written) and written.any()


# ---- the probe of a new build ----
@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """A cache folder holding a build that was never probed: a copy of this machine's build (what the compiler
    makes is the same file; tests/test_cpu_kernels.py builds one into an empty cache for real)."""
    from engine.config import cache_dir
    assert cpu_kernels.library() is not None
    root = tmp_path_factory.mktemp("cache")
    built, copy = (build.library_path(cpu_kernels.compiler(), cpu_kernels.cpu_flags(), r) for r in (cache_dir(), root))
    copy.parent.mkdir(parents=True)
    shutil.copy(built, copy)
    return root


@pytest.mark.parametrize("fault", ["SIGILL", "SIGSEGV", "SIGABRT"])
def test_a_build_whose_probe_dies_leaves_the_engine_on_the_plain_path(fresh_cache, monkeypatch, caplog, fault):
    from engine.execution.backends import select_backend
    monkeypatch.setenv("BATCHSCOPE_CACHE", str(fresh_cache))
    monkeypatch.setenv("BATCHSCOPE_PROBE_FAULT", fault)
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert f"died of {fault} in rms_norm" in caplog.text          # why, and in which op
        assert not list(fresh_cache.glob("kernels/*.probed"))
        assert select_backend("auto", torch.device("cpu"), 16, 64, torch.float32).name == "torch-sdpa"
        assert not cpu_kernels.fused_chains()
    finally:
        cpu_kernels.library.cache_clear()


def test_one_openmp_runtime_in_the_process():
    """The library links the OpenMP runtime torch loaded, so the process has one pool of threads."""
    assert cpu_kernels.library() is not None
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1, gomp
    if build.torch_openmp() is not None:
        assert Path(next(iter(gomp))).resolve() == build.torch_openmp().resolve()


# ---- non-finite values stay non-finite with the kernels on ----
def save_kernel_sized_model(folder: Path) -> Path:
    """A random 2-layer Llama with head_dim 64, so that every kernel serves it (tests/helpers' has 16)."""
    import shutil

    import transformers as tf

    from tests.helpers import default_model_folder
    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    for f in default_model_folder().iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_nan_in_one_requests_cache_fails_it_and_the_others_go_on(tmp_path, dtype):
    """NaN in one request's cached keys and values mid-reply, with the kernels on (compiled without
    -ffinite-math-only): its logits go non-finite, it fails with that reason, and the other reply is
    what it is without it."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    folder = save_kernel_sized_model(tmp_path / "m")
    kw = dict(model=str(folder), dtype=dtype, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    good_ids, bad_ids = [300 + i for i in range(9)], [500 + i for i in range(11)]
    want = LLMEngine(EngineConfig(**kw)).generate([good_ids], params)[0]["token_ids"]
    eng = LLMEngine(EngineConfig(**kw))
    assert eng.runner.model.layers[0].self_attn.backend.name == "cpu-paged"
    good, bad = eng.add_request(prompt_token_ids=good_ids, params=params), eng.add_request(prompt_token_ids=bad_ids,
                                                                                          params=params)
    outputs = {good: [], bad: []}
    poisoned = False
    while eng.has_unfinished():
        step = eng.step()
        for out in step.outputs if step else []:
            outputs[out.request_id].append(out)
        seq = eng.book.live.get(bad)
        if not poisoned and seq is not None and seq.output_token_ids:     # its prompt is done: poison its blocks
            eng.runner.kv_cache[:, :, seq.block_table] = float("nan")
            poisoned = True
    assert poisoned
    assert outputs[bad][-1].finish_reason == "error" and "non-finite" in outputs[bad][-1].error
    assert outputs[good][-1].finish_reason == "length"
    assert [t for o in outputs[good] for t in o.token_ids] == want
