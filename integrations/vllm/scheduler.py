"""The recording scheduler classes, over vLLM's own (recorder.py has the hooks).

Importable only where vLLM is installed, and only for the versions it was tested with
(SUPPORTED): the subclass reads scheduler state that vLLM does not promise to keep.
"""
from __future__ import annotations

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

SUPPORTED = ((0, 32), (0, 33))          # [from, to): vLLM minor versions tested


def version_tuple(text: str) -> tuple[int, int]:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_version(text: str = vllm.__version__):
    lo, hi = SUPPORTED
    if not lo <= version_tuple(text) < hi:
        raise ImportError(f"batchscope's vLLM recorder was tested with vLLM {lo[0]}.{lo[1]}.x; this is vLLM {text}. "
                          f"Install a tested version (pip install 'batchscope[vllm]') or run without the recorder.")


check_version()

from integrations.vllm.recorder import StepRecorder, engine_name  # noqa: E402  (after the version check)

ENGINE = engine_name()


class RecordingScheduler(StepRecorder, Scheduler):
    """vLLM's scheduler, recording: the one name for --scheduler-cls. vLLM runs a custom class as it is,
    whether its async scheduling is on or off, so this one becomes the async variant when it is on
    (vLLM's default where the executor supports it) and stays the plain one when it is off."""

    def __new__(cls, *args, **kwargs):
        if cls is RecordingScheduler and _async(args, kwargs):
            cls = RecordingAsyncScheduler
        return super().__new__(cls)


class RecordingAsyncScheduler(RecordingScheduler, AsyncScheduler):
    """vLLM's async scheduler, recording (RecordingScheduler picks it when async scheduling is on)."""

    def __init__(self, *args, **kwargs):
        if not _async(args, kwargs):
            raise ValueError("async scheduling is off: use --scheduler-cls integrations.vllm.RecordingScheduler")
        super().__init__(*args, **kwargs)


def _async(args: tuple, kwargs: dict) -> bool:
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    return bool(vllm_config is not None and vllm_config.scheduler_config.async_scheduling)
