"""batchscope's recorder for vLLM (v1 engine): a scheduler subclass that publishes every step as a
StepRecord, for `batchscope serve --attach` (docs/vllm.md).

    vllm serve MODEL --scheduler-cls integrations.vllm.RecordingScheduler

  reading.py    one scheduling step read as records (pure: no vLLM import)
  recorder.py   the hooks around vLLM's scheduler methods, the record's assembly
  publisher.py  the records on a TCP socket, never in vLLM's way
  scheduler.py  the classes to name in --scheduler-cls (needs a tested vLLM)

The class names below load on first use, so reading.py and publisher.py import without vLLM.
"""
from __future__ import annotations

import importlib

_EXPORTS = ("RecordingScheduler", "RecordingAsyncScheduler", "SUPPORTED", "ENGINE", "check_version")
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'integrations.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module("integrations.vllm.scheduler"), name)
