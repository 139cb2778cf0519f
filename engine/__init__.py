"""batchscope's inference engine: pure Python + torch, no web code.

Read it along a request's path: sequence -> scheduler / block_manager ->
model_runner (attention, models/llama) -> sampler / detokenizer -> llm_engine.
The records it publishes are defined in records.

The names below load on first use, so `import engine.scheduling.scheduler` (pure Python)
does not pull in torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"EngineConfig": "engine.config", "LLMEngine": "engine.llm_engine",
            "SamplingParams": "engine.sampling_params",
            "Sequence": "engine.scheduling.sequence", "Status": "engine.scheduling.sequence"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
