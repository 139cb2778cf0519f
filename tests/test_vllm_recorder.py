"""The vLLM recorder (integrations/vllm), model-free: vLLM's real scheduler with no model behind it.

As vLLM's own scheduler tests do, the test plays the engine: it adds requests, calls schedule(),
makes up the model's sampled tokens and calls update_from_output(). It keeps its own account of
every request (tokens computed, reply tokens given, preemptions) and checks each record against
it and against the scheduler's output: tokens per request, the budget held, decodes and prefill
chunks labelled truthfully, stalls with their causes, no request lost, no KV block leaked.

Runs where vLLM is installed (scripts/install_vllm.sh; tests/test_vllm_venv.py runs it there
from the main suite); skipped elsewhere.
"""
from __future__ import annotations

import random

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/install_vllm.sh makes a venv)")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from integrations.vllm import (
    RecordingAsyncScheduler,  # noqa: E402
    reading,  # noqa: E402
)
from integrations.vllm.reading import label_of  # noqa: E402
from tests.vllm_driver import BLOCK, MAX_LEN, NAMES, Driver, kv_cache, make_scheduler, shared_config  # noqa: E402


def check_step(rec: dict, out, replying: set[str], before: dict, budget: int, seqs: int):
    items = {it["req"]: it for it in rec["items"]}
    assert {r: it["tokens"] for r, it in items.items()} == dict(out.num_scheduled_tokens)
    assert rec["num_tokens"] == sum(it["tokens"] for it in rec["items"]) <= budget
    assert rec["token_budget"] == budget and rec["max_num_seqs"] == seqs
    kinds = [it["kind"] for it in rec["items"]]
    assert kinds == sorted(kinds, key=lambda k: k != "decode"), "decodes first"
    for rid, it in items.items():
        start, prompt, reply = before[rid]
        assert it["start"] == start, "start is where the request's computed tokens stood"
        assert it["label"] == label_of(rid) and it["label"] in NAMES
        context = f"{rid}: item {it}, before (start, prompt, reply) = {before[rid]}"
        if it["kind"] == "decode":     # one new token of a running reply: its last known token, computed now
            assert reply > 0 and start == prompt + reply - 1 and it["tokens"] == 1, context
        else:                          # a chunk of the prompt, or of prompt + reply when recomputing
            assert it["prompt_len"] == prompt + reply and start + it["tokens"] <= prompt + reply
            assert it["completes_prompt"] == (start + it["tokens"] == prompt + reply)
            assert it.get("cached", 0) % BLOCK == 0
    assert set(rec["preempted"]) == set(out.preempted_req_ids or ())
    for rid, cause in zip(rec["stalled"], rec["stall_causes"]):
        assert cause["req"] == rid and rid in replying and rid not in items
        if cause["cause"] == "budget":
            assert rec["num_tokens"] == budget
        else:
            assert cause["cause"] == "kv_full" and rec["preempted"]
    left_out = replying - set(items) - set(rec["preempted"])
    assert set(rec["stalled"]) <= left_out
    if rec["num_tokens"] == budget:
        assert set(rec["stalled"]) == left_out, "every reply left out while the budget was spent is a stall"
    kv = rec["kv"]
    assert 0 <= kv["used"] <= kv["total"] and kv["block_size"] == BLOCK


SHAPES = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31), "chunked": st.booleans(), "asynchronous": st.booleans(),
    "budget": st.sampled_from([32, 64, 256]), "seqs": st.integers(2, 6),
    "blocks": st.sampled_from([12, 24, 400]),         # 12: a few requests fill it and force preemptions
    "threshold": st.sampled_from([0, 0, 24]),         # long_prefill_token_threshold
})


def by_t(events: list[dict], kind: str) -> list[float]:
    return [e["t"] for e in events if e["event"] == kind]


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=SHAPES)
@example(shape={"seed": 6, "chunked": False, "asynchronous": False, "budget": 64, "seqs": 6, "blocks": 24,
                "threshold": 0})   # an abort after the last step: its blocks are freed with no record after
def test_every_record_matches_the_scheduler(monkeypatch, shape):
    vllm_config = shared_config()
    rng = random.Random(shape["seed"])
    budget, seqs, chunked = shape["budget"], shape["seqs"], shape["chunked"]
    sched, got = make_scheduler(vllm_config, chunked=chunked, budget=budget, seqs=seqs, blocks=shape["blocks"],
                                threshold=shape["threshold"], asynchronous=shape["asynchronous"],
                                monkeypatch=monkeypatch)
    drv = Driver(sched, rng, chunked, budget)
    longest = min(MAX_LEN // 2, (shape["blocks"] - 2) * BLOCK // 2)
    if not chunked:
        longest = min(longest, budget)         # vLLM refuses a whole prompt longer than its budget
    arrived, aborted = [], set()
    for t in range(400):
        if t < 150 and rng.random() < 0.25:
            arrived.append(drv.add(rng.choice(NAMES), rng.randint(1, longest), rng.randint(1, 24),
                                   shared=rng.random() < 0.3))
        if arrived and rng.random() < 0.02:
            rid = rng.choice(arrived)
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            if rid not in drv.ended:
                aborted.add(rid)
                drv.ended.add(rid)
        if not sched.has_requests():
            continue
        n = len(got)
        out, replying, before = drv.step()
        steps = [r for r in got[n:] if r["type"] == "step"]
        if out.num_scheduled_tokens or out.preempted_req_ids:
            assert len(steps) == 1
            check_step(steps[0], out, replying, before, budget, seqs)
        else:
            assert not steps
    while sched.has_requests():
        drv.step()
    # ---- the stream as a whole ----
    step_recs = [r for r in got if r["type"] == "step"]
    assert [r["step"] for r in step_recs] == list(range(len(step_recs)))
    events = [r for r in got if r["type"] == "request"]
    by = lambda kind: [e["req"] for e in events if e["event"] == kind]
    assert sorted(by("arrived")) == sorted(arrived)
    ended = by("finished") + by("aborted")
    assert sorted(ended) == sorted(arrived), "no request lost, none ended twice"
    assert set(by("aborted")) == aborted
    assert len(set(by("first_token"))) == len(by("first_token"))
    finished = {e["req"]: e for e in events if e["event"] == "finished"}
    for rid, e in finished.items():
        assert e["output_tokens"] == drv.reply[rid] and e["finish_reason"] in ("stop", "length")
    assert set(by("preempted")) == drv.preempted
    # no KV block leaked: the pool, read as the recorder reads it, once every request has ended (the last
    # record can predate an abort, which frees blocks without a step after it)
    assert reading.read_kv(sched.kv_cache_manager.block_pool, BLOCK).used == 0, "a KV block leaked"
    if not aborted or max(by_t(events, "aborted")) < step_recs[-1]["t_end"]:
        assert step_recs[-1]["kv"]["used"] == 0 and step_recs[-1]["running"] == 0
    produced = {it["req"] for r in step_recs for it in r["items"]
                if it["kind"] == "decode" or it.get("completes_prompt")}
    assert set(by("first_token")) <= produced


def test_a_vllm_stream_gives_the_pages_metrics(monkeypatch):
    """app/readers/metrics.py reads vLLM's records as it reads batchscope's: TTFT for each reply, TBTs, stalls."""
    from app.readers import analysis, metrics
    sched, got = make_scheduler(shared_config(), chunked=True, budget=32, seqs=4, blocks=400, threshold=0,
                                asynchronous=False, monkeypatch=monkeypatch)
    drv = Driver(sched, random.Random(1), True, 32)
    replies = [drv.add(n, 4, 12, shared=False) for n in ("Alice", "Bob", "Chen")]
    for _ in range(3):
        drv.step()
    doc = drv.add("Doc", 300, 2, shared=False)        # a long prompt: chunks of the budget beside the decodes
    while sched.has_requests():
        drv.step()
    steps = metrics.steps(got)
    chunks = [it for r in steps for it in r["items"] if it["req"] == doc and it["kind"] == "prefill"]
    assert len(chunks) >= 300 // 32 and sum(c["tokens"] for c in chunks) == 300
    mixed = [r for r in steps if {it["kind"] for it in r["items"]} == {"decode", "prefill"}]
    assert mixed, "the document's chunks ran beside the replies' decodes"
    assert set(metrics.ttfts(got)) == set(replies) | {doc}
    assert all(len(metrics.tbts(got)[r]) >= 1 for r in replies if drv.reply[r] > 1)
    assert metrics.summarize(got)["output_tokens"] == sum(drv.reply.values())
    assert isinstance(analysis.cause_time(got), list)
    policy = sched.recording.policy_event().to_dict()
    assert policy["engine"].startswith("vllm ") and policy["max_num_batched_tokens"] == 32


def test_labels_are_the_ids_clients_sent():
    assert label_of("chatcmpl-Alice-0123abcd") == "Alice"
    assert label_of("cmpl-Bob-9f9f9f9f-0") == "Bob-9f9f9f9f-0"       # n > 1 choices keep their index
    assert label_of("chatcmpl-" + "a" * 32 + "-0123abcd") == "a" * 8
    assert label_of("plain") == "plain"
    assert len(label_of("chatcmpl-" + "x" * 80 + "-0123abcd")) == 32


def test_the_async_class_named_with_async_scheduling_off_is_refused(monkeypatch):
    vllm_config = shared_config()
    monkeypatch.setenv("BATCHSCOPE_RECORDS_PORT", "off")
    vllm_config.scheduler_config.async_scheduling = False
    vllm_config.cache_config.num_gpu_blocks = 100
    with pytest.raises(ValueError, match="integrations.vllm.RecordingScheduler"):
        RecordingAsyncScheduler(vllm_config=vllm_config, kv_cache_config=kv_cache(100),
                                structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)


def test_only_the_tested_vllm_versions_load_the_recorder():
    from integrations.vllm.scheduler import check_version
    check_version("0.32.0")
    check_version("0.32.7+cpu")
    for untested in ("0.31.2", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(ImportError, match="tested with vLLM 0.32"):
            check_version(untested)


def spec_scheduler(monkeypatch, k: int, **shape):
    """A recording scheduler of a vLLM server started with --speculative-config '{"method": "ngram", ...}'."""
    from vllm.config import SpeculativeConfig
    vc = shared_config()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1,
                             target_model_config=vc.model_config, target_parallel_config=vc.parallel_config)
    monkeypatch.setattr(vc, "speculative_config", spec)
    return make_scheduler(vc, **{"chunked": True, "budget": 64, "seqs": 4, "blocks": 400, "threshold": 0,
                                 "asynchronous": False, **shape}, monkeypatch=monkeypatch)


@pytest.mark.parametrize("seed, blocks", [(0, 400), (1, 400), (2, 12)])
def test_each_decode_carries_vllms_drafted_and_accepted_tokens(monkeypatch, seed, blocks):
    """With a speculative config, each decode that verifies drafts carries them (`tokens` = 1 + `drafted`) and
    the number the model accepted, as vLLM's update_from_output counts them: over the run the records' sums
    are vLLM's own spec-decoding stats (less the placeholders it pads a request admitted with one token left
    with, which the records read as a prefill). With a small cache requests are also preempted."""
    from app.readers import metrics
    sched, got = spec_scheduler(monkeypatch, 3, blocks=blocks)
    assert sched.recording.settings["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    rng = random.Random(seed)
    drv = Driver(sched, rng, True, 64, drafts=3)
    small = blocks < 100                  # three prompts fill it; their replies do not fit
    for i, name in enumerate(NAMES):
        drv.add(name, 56 if small else rng.randint(8, 80), 40 if small else rng.randint(8, 30),
                shared=not small and i % 2 == 0)
    padded = 0
    while sched.has_requests():
        n = len(got)
        out, replying, before = drv.step()
        steps = [r for r in got[n:] if r["type"] == "step"]
        if not steps:
            continue
        rec, spec = steps[0], out.scheduled_spec_decode_tokens
        assert rec["speculative"] == 3 and "prefix_caching" not in rec
        for it in rec["items"]:
            rid = it["req"]
            if it["kind"] == "decode" and spec.get(rid):
                assert it["drafted"] == len(spec[rid]) and it["accepted"] == drv.accepted[rid]
                assert it["tokens"] == 1 + it["drafted"] and it["start"] == before[rid][0]
            else:
                assert "drafted" not in it and "accepted" not in it
                padded += len(spec.get(rid, ()))
    steps = metrics.steps(got)
    drafted, accepted = metrics.drafts(steps)
    theirs = [s.spec_decoding_stats for s in drv.stats if s.spec_decoding_stats is not None]
    assert drafted > 0 and accepted > 0
    assert drafted + padded == sum(s.num_draft_tokens for s in theirs)
    assert accepted == sum(s.num_accepted_tokens for s in theirs)
    assert metrics.summarize(got)["output_tokens"] == sum(drv.reply.values())
    if blocks == 12:
        assert drv.preempted and {e["req"] for e in got if e.get("event") == "preempted"} == drv.preempted
        assert {r for rec in steps for r in rec["preempted"]} == drv.preempted


def test_prefix_hits_are_vllms_own(monkeypatch):
    """Items' `cached` are the tokens vLLM's prefix cache served at admission: a prompt read again finds all
    its full blocks but the last token's, and over the run the records' sum is vLLM's own prefix-cache hits."""
    sched, got = make_scheduler(shared_config(), chunked=True, budget=256, seqs=4, blocks=400, threshold=0,
                                asynchronous=False, monkeypatch=monkeypatch)
    drv = Driver(sched, random.Random(3), True, 256)
    first = drv.add("Alice", 64, 4, shared=True)
    while sched.has_requests():
        drv.step()
    again = [drv.add(name, 64, 4, shared=True) for name in ("Bob", "Chen")] + [drv.add("Dara", 40, 4, shared=False)]
    while sched.has_requests():
        drv.step()
    reads = {it["req"]: it for r in got if r["type"] == "step" for it in r["items"] if it["kind"] == "prefill"}
    assert "cached" not in reads[first] and "cached" not in reads[again[2]]
    assert [reads[r]["cached"] for r in again[:2]] == [48, 48]         # 64 tokens: 3 full blocks, the 4th recomputed
    theirs = sum(s.prefix_cache_stats.hits + s.prefix_cache_stats.preempted_hits for s in drv.stats)
    assert sum(it.get("cached", 0) for it in reads.values()) == theirs == 96
