"""The engine's public API: sampling options, stop conditions, records, events and bad input."""
import json

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.outputs.requests import Detokenizer
from engine.scheduling.sequence import Sequence

pytestmark = pytest.mark.model
HELLO = [{"role": "user", "content": "Tell me a short story about a cat."}]


def run(eng, **kw):
    return eng.generate(messages=[HELLO], **kw)[0]


def test_seeded_sampling_repeats_and_differs_across_seeds(default_engine_fp32):
    eng = default_engine_fp32
    p = lambda s: SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=s)
    a, b, c = run(eng, params=p(1)), run(eng, params=p(1)), run(eng, params=p(2))
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_top_k_one_is_greedy(default_engine_fp32):
    eng = default_engine_fp32
    greedy = run(eng, params=SamplingParams(max_tokens=12))
    topk1 = run(eng, params=SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3))
    assert topk1["token_ids"] == greedy["token_ids"]


def test_stop_string_truncates_and_never_streams_past_it(default_engine_fp32):
    eng = default_engine_fp32
    full = run(eng, params=SamplingParams(max_tokens=30))["text"]
    word = full.split()[3]
    rid = eng.add_request(messages=HELLO, params=SamplingParams(max_tokens=30, stop=[word]))
    seen = []
    while not eng.get_request(rid).is_finished:
        eng.step()
        seen.append(eng.get_request(rid).output_text)
    seq = eng.get_request(rid)
    assert seq.finish_reason == "stop" and word not in seq.output_text
    assert full.startswith(seq.output_text)
    assert all(word not in t for t in seen)        # held back while it could still become the stop string


def test_max_tokens_and_stop_token_ids(default_engine_fp32):
    eng = default_engine_fp32
    out = run(eng, params=SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    first = out["token_ids"][2]
    out2 = run(eng, params=SamplingParams(max_tokens=20, stop_token_ids=[first]))
    assert out2["token_ids"][-1] == first and out2["finish_reason"] == "stop"


def test_step_records_and_events_are_json_and_private(default_engine_fp32):
    eng = default_engine_fp32
    got = []
    eng.subscribe(got.append)
    try:
        run(eng, params=SamplingParams(max_tokens=6))
    finally:
        eng.unsubscribe(got.append)
    text = json.dumps(got)
    assert "cat" not in text                       # labels and counts only, never prompt or reply text
    steps = [r for r in got if r["type"] == "step"]
    events = [r["event"] for r in got if r["type"] == "request"]
    assert events[0] == "arrived" and "first_token" in events and events[-1] == "finished"
    first = steps[0]["items"][0]
    assert first["kind"] == "prefill" and first["completes_prompt"] and first["start"] >= 0
    assert all(it["kind"] == "decode" and it["tokens"] == 1 for s in steps[1:] for it in s["items"])
    for key in ("step", "t_start", "t_end", "policy", "token_budget", "max_num_seqs", "items", "num_tokens",
                "finished", "preempted", "kv", "waiting", "running"):
        assert key in first or key in steps[0]


def test_shared_system_prompt_hits_the_prefix_cache(default_engine_fp32):
    eng = default_engine_fp32
    system = {"role": "system", "content": "You are a patient teacher. " * 20}
    eng.generate(messages=[[system, {"role": "user", "content": "Hi"}]], params=SamplingParams(max_tokens=2))
    got = []
    eng.subscribe(got.append)
    try:
        eng.generate(messages=[[system, {"role": "user", "content": "Hello there"}]],
                     params=SamplingParams(max_tokens=2))
    finally:
        eng.unsubscribe(got.append)
    first = next(r for r in got if r["type"] == "step")["items"][0]
    assert first["cached"] >= 100 and first["start"] == first["cached"]


def test_bad_input_names_the_problem_and_others_keep_running(default_engine_fp32):
    eng = default_engine_fp32
    ok = eng.add_request(messages=HELLO, params=SamplingParams(max_tokens=8))
    eng.step()
    cases = [
        (dict(prompt=""), "prompt must be a non-empty string"),
        (dict(prompt="x" * 40000), "limit is"),
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "role"),
        (dict(prompt_token_ids=[10**9]), "prompt_token_ids"),
        (dict(prompt="a", messages=HELLO), "exactly one"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.add_request(**kwargs)
    for kwargs, msg in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                        (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
                        (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kwargs)
    with pytest.raises(KeyError, match="unknown request id"):
        eng.abort("no-such-request")
    with pytest.raises(ValueError, match="policy"):
        eng.set_policy("fastest")
    while eng.has_unfinished():
        eng.step()
    assert eng.get_request(ok).finish_reason in ("stop", "length")
    assert eng.block_manager.num_used == 0


def test_abort_frees_blocks_at_once(default_engine_fp32):
    eng = default_engine_fp32
    rid = eng.add_request(messages=HELLO, params=SamplingParams(max_tokens=50))
    eng.step()
    assert eng.block_manager.num_used > 0
    assert eng.abort(rid, "client went away")
    assert eng.block_manager.num_used == 0 and eng.get_request(rid).finish_reason == "abort"
    assert not eng.abort(rid)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_detokenizer_never_emits_half_a_character(default_engine_fp32):
    tok = default_engine_fp32.tokenizer
    text = "Chinese 你好世界 and emoji 🐈 done"
    ids = tok.encode(text, add_special_tokens=False)
    s = Sequence("d", "d", [1], SamplingParams(), 0.0)
    det = Detokenizer(tok)
    for t in ids:
        s.output_token_ids.append(t)
        det.update(s)
        assert "\ufffd" not in s.output_text
    det.update(s, final=True)
    assert s.output_text == text
