"""Disaggregated prefill/decode (engine/disagg/router.py) on the real default model: the same greedy tokens as
transformers, prompts only on the prefill worker and replies only on the decode worker, every block
given back on both workers after aborts at any moment; and a killed worker restarted (on the tiny random
model: what is checked there is which requests fail and that the survivor's tokens are the single engine's)."""
import os
import random
import signal
import time

import pytest

from engine import EngineConfig, SamplingParams
from engine.disagg.router import DisaggregatedEngine
from tests.helpers import CHAT_PROMPTS, hf_greedy

pytestmark = pytest.mark.model
MAX_NEW = 16
BLOCK = 16
CONFIG = dict(dtype="float32", kv_cache_gb=0.1, max_model_len=1024, block_size=BLOCK)


def document_ids(engine, n: int, seed: int = 0) -> list[int]:
    """A prompt of n real-text tokens (a report), shifted by seed so no two share a prefix."""
    from app.replay.scenarios import load_text
    ids = engine.tokenizer(load_text("lighthouse_report"))["input_ids"]
    return ids[seed:seed + n]


@pytest.fixture(scope="module")
def engine():
    with DisaggregatedEngine(EngineConfig(**CONFIG)) as eng:
        yield eng


def drive(eng, until, timeout: float = 120.0) -> list[dict]:
    """Step the router until until() holds; the step records seen."""
    records, deadline = [], time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        rec = eng.step(timeout=1.0)
        if rec is not None:
            records.append(rec)
    return records


def assert_nothing_held(eng):
    kv = eng.worker_kv()
    for name, w in kv.items():
        assert w["free"] == w["total"], f"{name} worker still holds {w['total'] - w['free']} blocks"
        assert (w["live"], w["inbox"], w["outbox"]) == (0, 0, 0), f"{name}: {w}"
    assert kv["prefill"]["staging_free"] == eng.staging.shape[0], "staging slots not given back"
    assert not eng.router.transfers and not eng.router.holder


def test_greedy_replies_match_transformers(engine, hf_default_model):
    eng = engine
    prompts = [eng.tokenize(messages=[{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    prompts.append(document_ids(eng, 300))                 # 19 blocks to hand over
    refs = [hf_greedy(hf_default_model, ids, MAX_NEW) for ids in prompts]
    events = []
    eng.subscribe(events.append)
    try:
        eng.set_policy(max_num_batched_tokens=32, max_num_seqs=4)    # prompts in chunks, beside decodes
        rids = []
        for ids in prompts:                                   # staggered: some arrive while others decode
            rids.append(eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=MAX_NEW)))
            drive(eng, lambda: True)
            eng.step(timeout=1.0)
        drive(eng, lambda: not eng.has_unfinished())
    finally:
        eng.unsubscribe(events.append)
    for ids, ref, rid in zip(prompts, refs, rids):
        assert eng.get_request(rid).output_token_ids == ref, f"prompt of {len(ids)} tokens diverged"
    steps = [e for e in events if e["type"] == "step"]
    assert {s["policy"] for s in steps} == {"disaggregated"}
    assert all(i["kind"] == "prefill" for s in steps if s["worker"] == "prefill" for i in s["items"])
    assert all(i["kind"] == "decode" for s in steps if s["worker"] == "decode" for i in s["items"])
    transfers = {e["req"]: e for e in events if e.get("event") == "kv_transfer"}
    for ids, rid in zip(prompts, rids):
        t = transfers[rid]
        assert t["blocks"] == -(-len(ids) // BLOCK) and t["bytes"] == t["blocks"] * 2 * 30 * BLOCK * 3 * 64 * 4
        assert t["seconds"] > 0 and (t["from_worker"], t["to_worker"]) == ("prefill", "decode")
        first = next(e for e in events if e.get("event") == "first_token" and e["req"] == rid)
        first_decode = min(s["t_start"] for s in steps if s["worker"] == "decode"
                           for i in s["items"] if i["req"] == rid)
        assert first["t"] <= t["t"] <= first_decode          # one clock: prefill, hand-over, decode
    assert_nothing_held(eng)


def add_in_hand_over(eng, ids, params, holds=(3.0, 6.0, 12.0, 24.0)) -> str:
    """Add a request and step until its KV waits in the staging area, exported and not yet adopted: the decode
    worker is held (asleep) meanwhile. The hold is a time, and a busy machine can spend it all on the prefill;
    then the request is adopted before the router looks, and it is ended and tried again, held twice as long."""
    for hold in holds:
        eng.pause_worker("decode", hold)
        rid = eng.add_request(prompt_token_ids=ids, params=params)
        drive(eng, lambda: eng.router.holder.get(rid) == "decode")     # exported (and perhaps adopted already)
        if rid in eng.router.transfers:
            return rid
        eng.abort(rid, "missed the hand-over")
        assert_nothing_held(eng)
    raise AssertionError(f"the prefill outlasted every hold of the decode worker ({holds} s)")


def test_aborts_in_prefill_transfer_and_decode_free_every_block(engine):
    eng = engine
    eng.set_policy(max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    # during prefill: a 20-chunk prompt, stopped after its first chunk
    rid = eng.add_request(prompt_token_ids=document_ids(eng, 320, 1), params=params)
    drive(eng, lambda: eng.get_request(rid).num_computed_tokens or eng.workers["prefill"].last)
    assert eng.router.holder[rid] == "prefill"
    assert eng.abort(rid, "student closed the tab")
    assert_nothing_held(eng)
    # during the hand-over: the decode worker is held, so the KV waits in the staging area
    rid = add_in_hand_over(eng, document_ids(eng, 40, 2), params)
    assert eng.abort(rid, "student closed the tab")
    assert_nothing_held(eng)
    # during decode
    rid = eng.add_request(prompt_token_ids=document_ids(eng, 40, 3), params=params)
    drive(eng, lambda: eng.get_request(rid).num_output_tokens >= 3)
    assert eng.router.holder[rid] == "decode"
    assert eng.abort(rid, "student closed the tab")
    assert eng.get_request(rid).error == "student closed the tab"
    assert_nothing_held(eng)


def test_an_abort_that_crosses_a_hand_over_is_settled_before_the_pair_says_it_is_idle(engine):
    """The prefill worker exports a request while the router, not yet having read that, aborts it: the
    router must not call itself idle (and so stop reading the workers) until the worker has answered the
    abort, by which time the export's staging slots are given back. Before, they stayed held until the
    next request came."""
    eng = engine
    rid = eng.add_request(prompt_token_ids=document_ids(eng, 20, 7), params=SamplingParams(max_tokens=50))
    time.sleep(3.0)                      # the prefill worker prefills and exports it; nobody reads the news
    eng.abort(rid, "gone")
    assert eng.has_unfinished()          # the worker has not answered the abort yet
    drive(eng, lambda: not eng.has_unfinished(), timeout=60)
    assert eng.get_request(rid).finish_reason == "abort"
    assert_nothing_held(eng)


def test_a_burst_sent_to_an_idle_pair_is_counted_as_waiting_at_once(engine):
    """The server's queue limit reads num_waiting when it admits. The prefill worker says how many wait only
    in its step records, and an idle worker sends none: requests sent since its last record are counted too,
    so a burst is, and an aborted one stops counting at once."""
    eng = engine
    drive(eng, lambda: not eng.has_unfinished())
    assert eng.num_waiting == 0
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    rids = [eng.add_request(prompt_token_ids=document_ids(eng, 30, 20 + i), params=params) for i in range(6)]
    assert eng.num_waiting == 6
    eng.abort(rids[-1], "gone")
    assert eng.num_waiting == 5
    drive(eng, lambda: not eng.has_unfinished())
    assert eng.num_waiting == 0
    assert [eng.get_request(r).finish_reason for r in rids] == ["length"] * 5 + ["abort"]


def test_aborts_at_random_moments_free_every_block(engine):
    """Many requests, each aborted (or not) after a random number of pump calls: nothing leaks."""
    eng, rng = engine, random.Random(16)
    eng.set_policy(max_num_batched_tokens=24, max_num_seqs=4)
    for round_ in range(4):
        rids = [eng.add_request(prompt_token_ids=document_ids(eng, rng.randint(5, 120), rng.randint(0, 50)),
                                params=SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True))
                for _ in range(rng.randint(2, 5))]
        doomed = {r: rng.randint(0, 12) for r in rids if rng.random() < 0.7}
        calls = 0
        while eng.has_unfinished():
            for r, at in doomed.items():
                if at == calls:
                    eng.abort(r, "gone")
            eng.step(timeout=1.0)
            calls += 1
        assert_nothing_held(eng)
        for r in rids:
            seq = eng.get_request(r)
            assert seq.finish_reason in ("length", "abort"), seq.finish_reason
            if seq.finish_reason == "length":
                assert seq.num_output_tokens == seq.params.max_tokens


@pytest.fixture(scope="module")
def tiny_single(tiny_model):
    from engine import LLMEngine
    return LLMEngine(EngineConfig(model=str(tiny_model), **CONFIG))


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_killed_worker_is_restarted_and_only_its_requests_fail(victim, tiny_model, tiny_single):
    with DisaggregatedEngine(EngineConfig(model=str(tiny_model), **CONFIG, max_num_batched_tokens=16)) as eng:
        # long enough to be still decoding when the other prompt's first chunks are done, on a fast model too
        decoding = eng.add_request(prompt_token_ids=document_ids(eng, 30, 4),
                                   params=SamplingParams(max_tokens=400, ignore_eos=True))
        drive(eng, lambda: eng.get_request(decoding).num_output_tokens >= 2)
        prompt = document_ids(eng, 400, 5)                   # 25 chunks of 16
        # the prefill worker sleeps before it reads this prompt, so at the kill the prompt is certainly still
        # there (on a busy machine it was once prefilled and handed over before the kill landed)
        eng.pause_worker("prefill", 5.0)
        prefilling = eng.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=8))
        assert eng.router.holder == {decoding: "decode", prefilling: "prefill"}
        os.kill(eng.workers[victim].process.pid, signal.SIGKILL)
        drive(eng, lambda: not eng.has_unfinished(), timeout=300)
        dead, alive = (decoding, prefilling) if victim == "decode" else (prefilling, decoding)
        assert eng.get_request(dead).finish_reason == "error"
        assert f"the {victim} worker process died (exit code -9)" in eng.get_request(dead).error
        survivor = eng.get_request(alive)
        assert survivor.error is None and survivor.finish_reason == "length"
        want = tiny_single.generate([survivor.prompt_token_ids], SamplingParams(
            max_tokens=survivor.params.max_tokens, ignore_eos=survivor.params.ignore_eos))[0]["token_ids"]
        assert survivor.output_token_ids == want
        assert eng.workers[victim].restarts == 1 and eng.stats()["worker_restarts"] == 1
        # the new worker serves again
        rid = eng.add_request(prompt_token_ids=prompt[:50], params=SamplingParams(max_tokens=4, ignore_eos=True))
        drive(eng, lambda: not eng.has_unfinished(), timeout=300)
        assert eng.get_request(rid).finish_reason == "length"
        assert_nothing_held(eng)
        # a worker that dies while the pair is idle is replaced before the next request reaches it
        eng.workers[victim].process.kill()
        eng.workers[victim].process.join(30)
        rid = eng.add_request(prompt_token_ids=prompt[:50], params=SamplingParams(max_tokens=4, ignore_eos=True))
        drive(eng, lambda: not eng.has_unfinished(), timeout=300)
        assert eng.get_request(rid).error is None and eng.get_request(rid).finish_reason == "length"
        assert eng.workers[victim].restarts == 2
        assert_nothing_held(eng)


def test_settings_and_refusals(engine):
    with pytest.raises(ValueError, match="disaggregated"):
        engine.set_policy("chunked")
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.set_policy(max_num_seqs=0)
    assert engine.settings()["policy"] == "disaggregated"
    stats = engine.stats()
    assert stats["policy"] == "disaggregated" and set(stats["workers"]) == {"prefill", "decode"}
    assert all(w["threads"] == max(1, (os.cpu_count() or 2) // 2) for w in stats["workers"].values())
    from engine import LLMEngine
    with pytest.raises(ValueError, match="DisaggregatedEngine"):
        LLMEngine(EngineConfig(policy="disaggregated"))



def test_workers_start_with_the_environment_of_the_moment(engine, monkeypatch):
    """Workers fork from a fork server that started with an earlier pair (engine/disagg/router.py worker_context):
    they must still see the environment as it is when they start, as spawned ones would. Workers started
    after BATCHSCOPE_CPU_KERNEL=0 is set run torch's attention where the earlier pair ran the CPU kernel."""
    from engine.kernels import cpu_kernels
    if cpu_kernels.library() is None:
        pytest.skip("no CPU kernel here (no C++ compiler?): switching it off changes nothing to see")
    assert {w.info["attention_backend"] for w in engine.workers.values()} == {"cpu-paged"}
    monkeypatch.setenv("BATCHSCOPE_CPU_KERNEL", "0")
    with DisaggregatedEngine(EngineConfig(**CONFIG)) as eng:
        assert {w.info["attention_backend"] for w in eng.workers.values()} == {"torch-sdpa"}
