"""What a process of the engine holds in memory, read where the kernel keeps it.

    resident_bytes()        this process's resident set size (RSS), in bytes
    resident_bytes(pid)     another process's (a worker of the disaggregated pair)

    release_free_heap()     hand the heap's free memory back to the system (glibc's malloc_trim)
    freeze_survivors()      collect, then keep what is left out of later full garbage collections

The KV cache's share is `ModelRunner.kv_cache_bytes` (the bytes of the cache's tensors); each
engine's `memory()` puts the two side by side, and the server's /healthz, /api/engine and
/metrics show that dict.

Two things move a CPU server's RSS after its start, and neither is a leak:
  - the KV cache is lazily zeroed memory: a page becomes resident when a block on it is first written.
    Free blocks are handed out least recently freed first (the prefix cache keeps what was freed last),
    so a busy server cycles through every block and its RSS climbs to the whole cache. The server
    claims the cache at start instead (EngineConfig.claim_kv_cache, set by `python -m app`).
  - the runner keeps freed memory in its heap between steps (model_runner.keep_freed_memory), so
    the largest step so far (a lesson's whole long prompt) sets a high-water mark. The server hands
    it back when it has been idle a while (app/serving/engine_loop.py).
"""
from __future__ import annotations

import os

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes(pid: int | str = "self") -> int | None:
    """Resident set size in bytes: the second field of /proc/<pid>/statm (pages) times the page size.
    None where there is no /proc (not Linux) or the process has ended."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


def release_free_heap() -> bool:
    """glibc: hand the free parts of every malloc arena back to the system (malloc_trim(0); a few ms).
    False without glibc."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def freeze_survivors():
    """Collect garbage, then move every object left to the collector's permanent generation (gc.freeze).
    For what lives as long as the process (the libraries, the model, the UI's blocks): a full collection walks
    every object it holds while holding the GIL, so a server's steps and streams pause for it (about 0.26 s
    over a ready server's 477,000 objects; docs/results.md, the server's garbage collections). The price: a
    frozen object that later ends up in a garbage cycle is never collected, so call it where what is held now
    is meant to stay."""
    import gc
    gc.collect()
    gc.freeze()
