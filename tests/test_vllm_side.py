"""demos/vllm/side.py (vLLM's row in demos.compare and demos.bench) against a stand-in vLLM: what it checks
before a run and how it names what is missing. The real runs: docs/results.md."""
from __future__ import annotations

import time

import pytest
import uvicorn

from demos.vllm import side as vllm_side
from integrations.vllm.publisher import Publisher
from tests.fake_vllm import SETTINGS, Thread, fake_vllm, free_port

pytestmark = pytest.mark.server


@pytest.fixture
def stand_in():
    vport = free_port()
    server = Thread(uvicorn.Config(fake_vllm([]), host="127.0.0.1", port=vport, log_level="warning"))
    server.run_in_thread()
    yield f"http://127.0.0.1:{vport}"
    server.should_exit = True


def test_a_vllm_with_its_recorder_is_read_for_the_runs_settings(stand_in):
    pub = Publisher("127.0.0.1", 0, {"type": "hello", "engine": "vllm 0.32.0", "lane": 0, "lanes": 1,
                                     "device": "cpu/bfloat16", "settings": SETTINGS, "time": time.time()})
    try:
        v = vllm_side.connect(stand_in + "/v1", f"127.0.0.1:{pub.port}")
    finally:
        pub.close()
    assert v.model == "SmolLM2-135M-Instruct" and v.url == stand_in
    assert v.settings["max_num_batched_tokens"] == 64 and v.dtype == "bfloat16" and v.name == "vllm-chunked"


def test_a_missing_vllm_or_recorder_is_named(stand_in):
    with pytest.raises(SystemExit, match="vLLM does not answer at .*--vllm-start"):
        vllm_side.connect(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(SystemExit, match="--scheduler-cls integrations.vllm.RecordingScheduler"):
        vllm_side.connect(stand_in, f"127.0.0.1:{free_port()}")


def test_request_ids_follow_the_labels_in_arrival_order():
    stream = [{"type": "request", "event": "arrived", "req": f"id{i}", "label": lab, "t": i}
              for i, lab in enumerate(["Alice", "Doc", "Alice"])]
    assert vllm_side.request_ids(stream, ["Alice", "Alice", "Doc", "Bob"]) == ["id0", "id2", "id1", None]
    table = vllm_side.table([("a", {"output_tokens_per_s": 12.5, "num_preemptions": 0, "ttft_p50_s": None})])
    assert "| a | 12.5 | – |" in table and table.count("\n") == 2
