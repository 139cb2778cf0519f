"""Data-parallel vLLM, model-free: two recording schedulers as vLLM builds them for two engines of a dense
model (each told it is alone: data_parallel_size 1, data_parallel_rank 0, only data_parallel_index says
its rank), each publishing on its own port; attach mode's Lanes finds and reads both, one lane each.

Runs where vLLM is installed (tests/test_vllm_venv.py runs it in the vLLM environment); skipped elsewhere.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/install_vllm.sh makes a venv)")

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from app.serving.attach_records import Lanes  # noqa: E402
from integrations.vllm import RecordingScheduler  # noqa: E402
from tests.vllm_driver import BLOCK, MAX_LEN, Driver, kv_cache, model_folder  # noqa: E402


def engine_config(rank: int) -> VllmConfig:
    init_none_hash(sha256)
    mc = ModelConfig(model=model_folder(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=MAX_LEN)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN,
                         enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False)
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=CacheConfig(block_size=BLOCK))
    vc.parallel_config.data_parallel_index = rank     # what vLLM's engine process sets (v1/engine/core.py)
    vc.cache_config.num_gpu_blocks = 200
    return vc


def two_free_ports() -> int:
    """A port p with p + 1 free too (engine r listens on the first engine's port + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                    return p
                except OSError:
                    continue
    raise RuntimeError("no two consecutive free ports")


def test_two_engines_are_two_lanes(monkeypatch):
    import random
    base = two_free_ports()
    monkeypatch.setenv("BATCHSCOPE_RECORDS_PORT", str(base))
    scheds = []
    for rank in (0, 1):
        vc = engine_config(rank)
        scheds.append(RecordingScheduler(vllm_config=vc, kv_cache_config=kv_cache(200), block_size=BLOCK,
                                         structured_output_manager=StructuredOutputManager(vc), log_stats=True))
    assert [s.publisher.port for s in scheds] == [base, base + 1]
    assert [s.recording.lane for s in scheds] == [None, 1], "rank 0 of a dense model does not know it has peers"
    got: list[dict] = []
    lock = threading.Lock()

    def take(obj):
        with lock:
            got.append(obj)
    lanes = Lanes("127.0.0.1", base, take, time.time())
    try:
        lanes.start(5.0)
        assert lanes.lanes == 2, "the second engine's recorder was found at the next port"
        drivers = [Driver(s, random.Random(rank), True, 64) for rank, s in enumerate(scheds)]
        names = {0: ["Alice", "Bob"], 1: ["Chen", "Dara", "Doc"]}
        ids = {rank: [drv.add(n, 20 + 30 * k, 6, shared=False) for k, n in enumerate(names[rank])]
               for rank, drv in enumerate(drivers)}
        while any(s.has_requests() for s in scheds):
            for s, drv in zip(scheds, drivers):
                if s.has_requests():
                    drv.step()
        want = sum(s.recording.step for s in scheds)
        deadline = time.time() + 10
        while time.time() < deadline and sum(o.get("type") == "step" for o in list(got)) < want:
            time.sleep(0.05)
        assert lanes.healthy, lanes.errors
    finally:
        lanes.stop()
        for s in scheds:
            s.publisher.close()
    steps = [o for o in got if o["type"] == "step"]
    assert len(steps) == want
    assert sorted(r["step"] for r in steps) == list(range(want)), "one numbering over both engines"
    for rank in (0, 1):
        mine = [r for r in steps if r["lane"] == rank]
        assert [r["lane_step"] for r in mine] == list(range(scheds[rank].recording.step)), "each engine's own count"
        ran = {it["req"] for r in mine for it in r["items"]}
        assert ran == set(ids[rank]), "an engine's lane holds exactly the requests that engine ran"
    finished = {rid for o in got if o["type"] == "request" and o["event"] == "finished" for rid in [o["req"]]}
    assert finished == set(ids[0]) | set(ids[1])
