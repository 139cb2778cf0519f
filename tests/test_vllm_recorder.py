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

import functools
import json
import random
import tempfile
import uuid
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/install_vllm.sh makes a venv)")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from integrations.vllm import RecordingAsyncScheduler, RecordingScheduler  # noqa: E402
from integrations.vllm.reading import label_of  # noqa: E402

BLOCK = 16
EOS = 2
MAX_LEN = 1024
NAMES = ["Alice", "Bob", "Chen", "Dara", "Doc"]


def model_folder() -> str:
    """A config.json is all a model-free scheduler reads (no weights, no tokenizer): a small Llama's."""
    folder = Path(tempfile.mkdtemp(prefix="vllm-config-"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "torch_dtype": "float32"}))
    return str(folder)


@functools.cache
def shared_config() -> VllmConfig:
    """Built once (it probes the platform); each scheduler sets the fields it varies."""
    mc = ModelConfig(model=model_folder(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=MAX_LEN)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    init_none_hash(sha256)
    return VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc)


def kv_cache(blocks: int) -> KVCacheConfig:
    """One attention layer's worth of blocks: the scheduler counts blocks, never their bytes."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])


def make_scheduler(vc, *, chunked: bool, budget: int, seqs: int, blocks: int, threshold: int, asynchronous: bool,
                   monkeypatch):
    monkeypatch.setenv("BATCHSCOPE_RECORDS_PORT", "off")
    sc = vc.scheduler_config
    sc.enable_chunked_prefill, sc.max_num_batched_tokens, sc.max_num_seqs = chunked, budget, seqs
    sc.long_prefill_token_threshold, sc.async_scheduling = threshold, asynchronous
    vc.cache_config.num_gpu_blocks = blocks
    kv = kv_cache(blocks)
    sched = RecordingScheduler(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
                               block_size=BLOCK, log_stats=True)
    assert isinstance(sched, RecordingAsyncScheduler) == asynchronous, "the one class name picks vLLM's base"
    got: list[dict] = []
    sched.recording.listeners.subscribe(got.append)
    return sched, got


class Driver:
    """Plays vLLM's engine core around the scheduler, and keeps its own account of each request."""

    def __init__(self, sched, rng: random.Random, chunked: bool, budget: int):
        self.s, self.rng, self.chunked, self.budget = sched, rng, chunked, budget
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.prompt: dict[str, int] = {}       # request -> prompt tokens
        self.reply: dict[str, int] = {}        # request -> reply tokens it has been given
        self.computed: dict[str, int] = {}     # request -> tokens in its KV cache (0 after a preemption)
        self.ended: set[str] = set()
        self.preempted: set[str] = set()

    def add(self, name: str, prompt_len: int, max_tokens: int, shared: bool):
        rid = f"chatcmpl-{name}-{uuid.uuid4().hex[:8]}"
        base = [7] * prompt_len if shared else [self.rng.randrange(3, 30000) for _ in range(prompt_len)]
        self.s.add_request(Request(rid, base, SamplingParams(max_tokens=max_tokens, stop_token_ids=[EOS]), None,
                                   block_hasher=self.hasher))
        self.prompt[rid], self.reply[rid], self.computed[rid] = prompt_len, 0, 0
        return rid

    def step(self) -> tuple:
        """One schedule + fake forward + update; returns (output, what was checked before the update)."""
        replying = {r.request_id for r in self.s.running if r.num_output_tokens > 0 and not r.is_prefill_chunk}
        out = self.s.schedule()
        for rid in out.preempted_req_ids or ():
            self.computed[rid] = 0
            self.preempted.add(rid)
        sampled = []
        admitted = {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.resumed_req_ids)
        for rid, n in out.num_scheduled_tokens.items():
            if rid in admitted:         # from a waiting queue: it starts where its prefix-cache hit ends
                assert self.computed[rid] == 0
                hit = self.s.requests[rid].num_computed_tokens - n
                assert hit % BLOCK == 0 and 0 <= hit < self.prompt[rid] + self.reply[rid]
                self.computed[rid] = hit
            self.computed[rid] += n
            done = self.computed[rid] >= self.prompt[rid] + self.reply[rid]
            sampled.append([EOS if self.rng.random() < 0.05 else self.rng.randrange(3, 30000)] if done else [])
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        before = {rid: (self.computed[rid] - n, self.prompt[rid], self.reply[rid])
                  for rid, n in out.num_scheduled_tokens.items()}
        result = self.s.update_from_output(out, mro)
        for rid, toks in zip(ids, sampled):
            self.reply[rid] += len(toks)
        for eco in result.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.ended.add(o.request_id)
        return out, replying, before


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


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=SHAPES)
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
    assert step_recs[-1]["kv"]["used"] == 0 and step_recs[-1]["running"] == 0, "no KV block leaked"
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
