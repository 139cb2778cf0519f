"""The vLLM dashboard's metrics, from a tiny engine's own records: vLLM's names, labels and buckets; the
phases add up to the TTFT and to each other; every way a request ends is counted by its reason."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.readers import metrics as defs
from app.serving.prometheus import REQUEST_LATENCY_BUCKETS, TBT_BUCKETS, TTFT_BUCKETS, Metrics, buckets_1_2_5
from engine import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three requests through a tiny engine (one aborted mid-reply), every record also kept as a stream."""
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))
    engine = LLMEngine(EngineConfig(model=str(folder), kv_cache_gb=0.02, cpu_threads=1, max_num_seqs=2))
    prom, stream = Metrics(), []
    stats = engine.stats()
    prom.attach("tiny", engine.max_model_len, stats["dtype"], stats["kv"])
    engine.subscribe(prom.observe)
    engine.subscribe(stream.append)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    rids = [engine.add_request(prompt_token_ids=list(range(5 + 7 * i, 40 + 7 * i)), params=params) for i in range(3)]
    while engine.get_request(rids[2]).num_output_tokens < 2:
        engine.step()
    engine.abort(rids[2])
    while any(not engine.get_request(r).is_finished for r in rids):
        engine.step()
    return engine, prom, stream, rids


def samples(prom: Metrics) -> dict[str, list]:
    text = generate_latest(prom.registry).decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(s: dict, name: str, **labels) -> float:
    return sum(x.value for x in s[name] if labels.items() <= x.labels.items())


def buckets(s: dict, name: str) -> tuple[float, ...]:
    return tuple(float(x.labels["le"]) for x in s[name + "_bucket"] if x.labels["le"] != "+Inf")


def test_names_labels_and_buckets_are_vllms(run):
    engine, prom, _, _ = run
    s = samples(prom)
    assert buckets(s, "vllm:time_to_first_token_seconds") == TTFT_BUCKETS
    assert buckets(s, "vllm:inter_token_latency_seconds") == TBT_BUCKETS
    assert buckets(s, "vllm:request_time_per_output_token_seconds") == TBT_BUCKETS
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_inference_time"):
        assert buckets(s, f"vllm:{name}_seconds") == REQUEST_LATENCY_BUCKETS
    assert buckets(s, "vllm:request_prompt_tokens") == buckets_1_2_5(engine.max_model_len)
    assert buckets_1_2_5(120) == (1, 2, 5, 10, 20, 50, 100)
    assert all(x.labels["engine"] == "0" and x.labels["model_name"] == "tiny"
               for name, xs in s.items() if name.startswith("vllm:") and "cache_config" not in name for x in xs)
    (info,) = s["vllm:cache_config_info"]
    kv = engine.stats()["kv"]
    assert info.value == 1 and info.labels["block_size"] == str(kv["block_size"])
    assert info.labels["num_gpu_blocks"] == str(kv["total"])
    assert value(s, "vllm:num_requests_waiting_by_reason", reason="capacity") == value(s, "vllm:num_requests_waiting")


def test_every_end_is_counted_by_its_reason(run):
    _, prom, _, _ = run
    s = samples(prom)
    assert value(s, "vllm:request_success_total", finished_reason="length") == 2
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert {x.labels["finished_reason"] for x in s["vllm:request_success_total"]} == {"stop", "length", "abort",
                                                                                    "error"}


def test_phases_add_up_and_match_the_stream(run):
    """Every time here is the stream's (app/readers/metrics.py): a token's time is its step's end, as on the page."""
    engine, prom, stream, rids = run
    s = samples(prom)
    times, arrived = defs.token_times(stream), defs.arrivals(stream)
    done = rids[:2]                                            # the finished ones; the aborted is not timed
    assert value(s, "vllm:request_queue_time_seconds_count") == 2
    ttft = sum(times[r][0] - arrived[r] for r in done)
    assert value(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(
        sum(times[r][0] - arrived[r] for r in rids), abs=1e-9)   # the aborted one had its first token too
    queue, prefill = value(s, "vllm:request_queue_time_seconds_sum"), value(s, "vllm:request_prefill_time_seconds_sum")
    assert queue + prefill == pytest.approx(ttft, abs=1e-9)
    decode = value(s, "vllm:request_decode_time_seconds_sum")
    assert prefill + decode == pytest.approx(value(s, "vllm:request_inference_time_seconds_sum"), abs=1e-9)
    assert decode == pytest.approx(sum(times[r][-1] - times[r][0] for r in done), abs=1e-9)
    assert value(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        sum((times[r][-1] - times[r][0]) / (len(times[r]) - 1) for r in done), abs=1e-9)
    assert value(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(times[r][-1] - arrived[r] for r in done), abs=1e-9)
    tbts = defs.tbts(stream)
    assert value(s, "vllm:inter_token_latency_seconds_count") == sum(len(g) for g in tbts.values())
    assert value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(sum(g) for g in tbts.values()))
    assert value(s, "vllm:request_generation_tokens_sum") == \
        value(s, "vllm:request_max_num_generation_tokens_sum") == 12
    assert value(s, "vllm:request_prompt_tokens_sum") == sum(engine.get_request(r).prompt_len for r in done)
    # the first scheduled step comes from the records: the stream's first step holding each request
    first = {}
    for rec in defs.steps(stream):
        for item in rec["items"]:
            first.setdefault(item["req"], rec["t_start"])
    assert queue == pytest.approx(sum(first[r] - arrived[r] for r in done), abs=1e-9)
    assert not prom.live and not prom.clock.last               # nothing kept for ended requests


def test_an_attached_stream_alone_gives_the_same_numbers(run):
    """Attach mode has no engine to ask: the same class fed only the recorded stream agrees with the live one."""
    engine, prom, stream, _ = run
    again = Metrics()
    stats = engine.stats()
    again.attach("tiny", engine.max_model_len, stats["dtype"], stats["kv"])
    for obj in stream:
        again.observe(obj)
    strip = lambda m: {k: sorted((tuple(sorted(x.labels.items())), x.value) for x in xs)
                       for k, xs in samples(m).items() if not k.endswith("_created")}
    assert strip(again) == strip(prom)


def test_a_failed_request_is_counted_as_an_error_not_an_abort(tmp_path):
    """The aborted event says which end it was (finish_reason), so /metrics needs nothing else."""
    folder = save_tiny_model("llama", tmp_path)
    engine = LLMEngine(EngineConfig(model=str(folder), kv_cache_gb=0.02, cpu_threads=1))
    prom = Metrics()
    stats = engine.stats()
    prom.attach("tiny", engine.max_model_len, stats["dtype"], stats["kv"])
    engine.subscribe(prom.observe)
    ok, bad = (engine.add_request(prompt_token_ids=list(range(3, 20)), params=SamplingParams(max_tokens=4))
               for _ in range(2))
    engine.step()
    engine._abort(engine.get_request(bad), "error", "the model produced non-finite logits")
    engine.abort(ok)
    s = samples(prom)
    assert value(s, "vllm:request_success_total", finished_reason="error") == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert not prom.live
