"""The server's memory, as /healthz, /api/engine and /metrics show it, against what the kernel and the model say.

Resident memory is compared with /proc/<pid>/status's VmRSS (the kernel's own line, read here, not the
code under test's /proc/<pid>/statm); the KV cache's bytes with the cache's shape, computed here from the
model's config and the number of blocks the engine reports."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_for

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]
SLACK = 64 * 2**20            # a live server allocates between two reads: RSS may move this much


def vm_rss(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS line for {pid}")


def cache_bytes(model_folder: Path, blocks: int, block_size: int, itemsize: int = 4) -> int:
    """(layers, 2, blocks + 1 scratch, block_size, kv_heads, head_dim) elements of itemsize bytes."""
    cfg = json.loads((model_folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * (blocks + 1) * block_size * cfg["num_key_value_heads"] * head_dim * itemsize


def gauges(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")


@needs_proc
def test_healthz_and_metrics_show_resident_memory_and_the_kv_cache(live_server, tiny_model):
    health = live_server.http.get("/healthz").json()
    mem = health["memory"]
    # the test server runs in this process: its resident memory is ours
    assert abs(mem["rss_bytes"] - vm_rss()) < SLACK, (mem, vm_rss())
    kv = live_server.engine()["kv"]
    want = cache_bytes(tiny_model, kv["total"], kv["block_size"])
    assert mem["kv_cache_bytes"] == want
    assert 0 < mem["kv_cache_bytes"] < mem["rss_bytes"]
    assert "workers" not in mem                          # no pair started
    assert live_server.engine()["memory"]["kv_cache_bytes"] == want   # /api/engine: the same definition
    samples = gauges(live_server.http.get("/metrics").text)
    assert abs(samples[("process_resident_memory_bytes", ())] - vm_rss()) < SLACK
    model = live_server.service.model_name
    assert samples[("batchscope:kv_cache_bytes", (("engine", "0"), ("model_name", model)))] == want


@needs_proc
def test_the_pairs_workers_memory_is_reported_by_pid(tiny_model):
    from engine import EngineConfig
    from tests.conftest import serve_on_loopback
    server = serve_on_loopback(EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.02,
                                            max_model_len=512, policy="disaggregated"))
    live = next(server)
    try:
        wait_for(lambda: live.engine()["disaggregated"] == "ready", timeout=240, what="the pair to load")
        state = live.engine()
        workers = state["workers"]
        wait_for(lambda: all(w["rss_bytes"] for w in live.http.get("/healthz").json()["memory"]["workers"].values()),
                 what="the workers' memory in /healthz")
        mem = live.http.get("/healthz").json()["memory"]
        samples = gauges(live.http.get("/metrics").text)
        model = live.service.model_name
        for name in ("prefill", "decode"):
            pid, w = workers[name]["pid"], mem["workers"][name]
            assert w["pid"] == pid
            assert abs(w["rss_bytes"] - vm_rss(pid)) < SLACK, (name, w, vm_rss(pid))
            kv = workers[name]["kv"]
            assert w["kv_cache_bytes"] == cache_bytes(tiny_model, kv["total"], state["kv"]["block_size"])
            labels = (("model_name", model), ("worker", name))
            assert abs(samples[("batchscope:worker_resident_memory_bytes", labels)] - vm_rss(pid)) < SLACK
            assert samples[("batchscope:worker_kv_cache_bytes", labels)] == w["kv_cache_bytes"]
        # the server process keeps the single engine (and its cache) beside the pair
        assert mem["kv_cache_bytes"] > 0 and abs(mem["rss_bytes"] - vm_rss()) < SLACK
    finally:
        server.close()                                   # the generator's finally: the service stops


def resident_in(start: int, nbytes: int) -> int:
    """Resident bytes of the mappings that overlap [start, start + nbytes), from the kernel's /proc/self/smaps
    (a large buffer may span several: the kernel splits mappings at huge-page boundaries)."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlaps = lo < start + nbytes and start < hi
        elif overlaps and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


RESIDENT_CACHE = """
import json, sys
from engine import EngineConfig, LLMEngine
from tests.test_server_memory import resident_in
engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", kv_cache_gb=0.1, claim_kv_cache=sys.argv[2] == "1"))
cache = engine.runner.kv_cache
print(json.dumps({"resident": resident_in(cache.data_ptr(), cache.nbytes), "nbytes": cache.nbytes,
                  "zeros": not cache.any()}))
"""


@needs_proc
@pytest.mark.parametrize("claim", [False, True])
def test_a_claimed_kv_cache_is_resident_from_the_start(tiny_model, claim):
    """claim_kv_cache (the server's default): every page of the cache resident once the engine has loaded, so
    RSS does not climb as the LRU free list cycles through the blocks; unclaimed, nothing is until written.
    In a fresh process, as a server starts: in a long-lived one the allocator may hand the cache memory that
    earlier engines freed, which calloc must clear, and so touch, either way."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", RESIDENT_CACHE, str(tiny_model), "1" if claim else "0"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["zeros"]                                  # zeros either way
    if claim:
        assert got["resident"] >= got["nbytes"] - 4096, got
    else:
        assert got["resident"] < got["nbytes"] // 10, got


def test_the_server_claims_its_kv_cache_unless_told_not_to():
    from app.__main__ import parse_args
    from engine import EngineConfig
    assert EngineConfig().claim_kv_cache is False        # the library: lazily zeroed
    assert parse_args([], env={}).claim_kv_cache is True    # `python -m app`: claimed at start
    assert parse_args(["--no-claim-kv-cache"], env={}).claim_kv_cache is False
    assert parse_args([], env={"BATCHSCOPE_CLAIM_KV_CACHE": "0"}).claim_kv_cache is False
    assert parse_args(["--serving"], env={}).claim_kv_cache is True


def test_a_lull_after_steps_hands_the_heap_back_once(live_server, monkeypatch):
    """After HEAP_IDLE_S with nothing to run, the engine thread calls release_free_heap, once per lull: an
    engine that stays idle does not call it again, and /healthz's memory is read again after it."""
    import app.serving.engine_loop as engine_loop
    calls = []
    real = engine_loop.release_free_heap
    monkeypatch.setattr(engine_loop, "release_free_heap", lambda: calls.append(time.monotonic()) or real())
    live_server.chat("Hi", max_tokens=3)
    ended = time.monotonic()
    wait_for(lambda: calls, timeout=30, what="the heap to be handed back after the reply")
    assert calls[0] - ended >= engine_loop.HEAP_IDLE_S * 0.9
    time.sleep(engine_loop.HEAP_IDLE_S * 2.5)
    assert len(calls) == 1                                   # idle since: nothing more to hand back
    live_server.chat("Hi again", max_tokens=3)
    wait_for(lambda: len(calls) == 2, timeout=30, what="the second lull's hand-back")
