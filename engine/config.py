"""Engine configuration: one small dataclass, checked when it is built.

torch is imported only where a config is built, so the scheduler (which reads
POLICIES and check_budgets from here) stays free of it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.scheduling.ngram import SpeculativeConfig

SCHEDULER_POLICIES = ("static", "continuous", "chunked")     # one engine, one scheduler
POLICIES = (*SCHEDULER_POLICIES, "disaggregated")             # + two engines (engine/disagg/router.py)
BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",   # accepted name -> torch dtype name
          "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "int8": "float32"}      # CPU: int8 linears (engine/weights/quant.py), fp32 activations and KV cache



def cache_dir() -> Path:
    """Where prepared models and built kernels live: $BATCHSCOPE_CACHE, else ~/.cache/batchscope."""
    root = os.environ.get("BATCHSCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchscope")
    return Path(root)


@dataclass
class EngineConfig:
    model: str | None = None            # local folder or Hub id; None = embedded SmolLM2-135M-Instruct
    device: str = "auto"                # "auto" -> cuda if available, else cpu
    dtype: str = "auto"                 # "auto" -> bf16 on CUDA and on CPUs with AMX, else fp32
    policy: str = "chunked"             # static | continuous | chunked | disaggregated (engine/disagg/router.py)
    max_num_batched_tokens: int = 256   # token budget of one step
    max_num_seqs: int = 64              # most sequences in one step: a room of 60 all in the batch at once
                                        # (docs/server.md, "A room at its peak"); lessons set their own
    max_prefill_chunk: int | None = None  # optional cap on one request's chunk (chunked policy)
    block_size: int = 16                # tokens per KV block
    kv_cache_gb: float = 1.0            # KV cache size on CPU
    claim_kv_cache: bool = False        # CPU: make every page of the KV cache resident at start, not when first
                                        # written (`python -m app` sets it: engine/memory.py says why)
    gpu_memory_utilization: float = 0.85  # fraction of the GPU memory free at start for weights, activations, KV
    num_kv_blocks: int | None = None    # overrides the two above (tests use it to force preemption)
    max_model_len: int | None = None    # defaults to the model's context length
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"     # auto | torch | cpu | triton | flash_attn (auto: see backends.select_backend)
    enforce_eager: bool = False         # CUDA: no CUDA graphs for decode steps
    seed: int = 0
    cpu_threads: int | None = None      # torch intra-op threads on CPU; None = torch's choice (one per core)
    # speculative decoding, vLLM's form: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N}
    # (engine/scheduling/ngram.py); None: off. Checked into a SpeculativeConfig.
    speculative_config: dict | SpeculativeConfig | None = None

    def __post_init__(self):
        import torch
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA device")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") or _cpu_has_amx() else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_budgets(self.max_num_batched_tokens, self.max_num_seqs, self.max_prefill_chunk)
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive integer or None, got {self.cpu_threads!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, DTYPES[self.dtype])


def check_scheduler_policy(policy: str):
    """A policy one scheduler can run; `disaggregated` is two engines, not a scheduling rule."""
    if policy == "disaggregated":
        raise ValueError("`disaggregated` runs a prefill engine and a decode engine in two processes: "
                         "build an engine.disagg.router.DisaggregatedEngine, not an LLMEngine")
    if policy not in SCHEDULER_POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def check_budgets(max_num_batched_tokens: int, max_num_seqs: int, max_prefill_chunk: int | None):
    if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be a positive integer, got {max_num_batched_tokens!r}")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
    if max_prefill_chunk is not None and (not isinstance(max_prefill_chunk, int) or max_prefill_chunk < 1):
        raise ValueError(f"max_prefill_chunk must be a positive integer or None, got {max_prefill_chunk!r}")


def _cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles: only then does "auto" pick bf16 on a CPU. Without them a bf16
    decode step (a matrix-vector product per linear) is slower than fp32, so fp32 stays (docs/results.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags
