"""vLLM's real v1 scheduler with no model behind it, driven as vLLM's own scheduler tests drive theirs:
add requests, schedule(), make up the sampled tokens, update_from_output(). Shared by the recorder's
tests (tests/test_vllm_recorder.py, tests/test_vllm_dp.py); importable only where vLLM is installed."""
from __future__ import annotations

import functools
import json
import random
import tempfile
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/install_vllm.sh makes a venv)")


import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from integrations.vllm import RecordingAsyncScheduler, RecordingScheduler  # noqa: E402

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
    sched = RecordingScheduler(vllm_config=vc, kv_cache_config=kv,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=BLOCK, log_stats=True)
    assert isinstance(sched, RecordingAsyncScheduler) == asynchronous, "the one class name picks vLLM's base"
    got: list[dict] = []
    sched.recording.listeners.subscribe(got.append)
    return sched, got


class Driver:
    """Plays vLLM's engine core around the scheduler, and keeps its own account of each request."""

    def __init__(self, sched, rng: random.Random, chunked: bool, budget: int, drafts: int = 0):
        self.s, self.rng, self.chunked, self.budget = sched, rng, chunked, budget
        self.drafts = drafts                   # > 0: propose up to this many draft tokens per reply, as n-gram does
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.prompt: dict[str, int] = {}       # request -> prompt tokens
        self.reply: dict[str, int] = {}        # request -> reply tokens it has been given
        self.computed: dict[str, int] = {}     # request -> tokens in its KV cache (0 after a preemption)
        self.ended: set[str] = set()
        self.preempted: set[str] = set()
        self.max_tokens: dict[str, int] = {}
        self.accepted: dict[str, int] = {}     # of the last step: request -> drafts the made-up model accepted
        self.stats: list = []                  # vLLM's own SchedulerStats, one per update that had any

    def add(self, name: str, prompt_len: int, max_tokens: int, shared: bool):
        rid = f"chatcmpl-{name}-{uuid.uuid4().hex[:8]}"
        base = [7] * prompt_len if shared else [self.rng.randrange(3, 30000) for _ in range(prompt_len)]
        self.s.add_request(Request(rid, base, SamplingParams(max_tokens=max_tokens, stop_token_ids=[EOS]), None,
                                   block_hasher=self.hasher))
        self.prompt[rid], self.reply[rid], self.computed[rid] = prompt_len, 0, 0
        self.max_tokens[rid] = max_tokens
        return rid

    def step(self) -> tuple:
        """One schedule + fake forward + update; returns (output, what was checked before the update)."""
        replying = {r.request_id for r in self.s.running if r.num_output_tokens > 0 and not r.is_prefill_chunk}
        out = self.s.schedule()
        for rid in out.preempted_req_ids or ():
            self.computed[rid] = 0
            self.preempted.add(rid)
        sampled, spec, before = [], out.scheduled_spec_decode_tokens, {}
        self.accepted = {}
        admitted = {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.resumed_req_ids)
        for rid, n in out.num_scheduled_tokens.items():
            if rid in admitted:         # from a waiting queue: it starts where its prefix-cache hit ends
                assert self.computed[rid] == 0
                hit = self.s.requests[rid].num_computed_tokens - n
                assert hit % BLOCK == 0 and 0 <= hit < self.prompt[rid] + self.reply[rid]
                self.computed[rid] = hit
            before[rid] = (self.computed[rid], self.prompt[rid], self.reply[rid])
            self.computed[rid] += n
            k = len(spec.get(rid, ()))         # drafts verified after the request's own token
            done = self.computed[rid] - k >= self.prompt[rid] + self.reply[rid]
            toks = [EOS if self.rng.random() < 0.05 else self.rng.randrange(3, 30000)] if done else []
            if done and k:                     # the model agrees with a prefix of the drafts; vLLM rolls back the rest
                real = -1 not in spec[rid]     # vLLM's padding placeholders are never a model's guess
                keep = self.rng.randint(0, min(k, self.max_tokens[rid] - self.reply[rid] - 1)) if real else 0
                toks = [self.rng.randrange(3, 30000) for _ in range(keep)] + toks
                self.computed[rid] -= k - keep
                self.accepted[rid] = keep
            sampled.append(toks)
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        result = self.s.update_from_output(out, mro)
        for rid, toks in zip(ids, sampled):
            self.reply[rid] += len(toks)
        for eco in result.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.ended.add(o.request_id)
            if eco.scheduler_stats is not None:
                self.stats.append(eco.scheduler_stats)
        if self.drafts:                        # the next step's drafts, as the model runner proposes them
            ids = [r.request_id for r in self.s.running if not r.is_prefill_chunk]
            self.s.update_draft_token_ids(DraftTokenIds(ids, [
                [self.rng.randrange(3, 30000) for _ in range(self.rng.randint(0, self.drafts))] for _ in ids]))
        return out, replying, before
