"""What a process of the engine holds in memory, read where the kernel keeps it.

    resident_bytes()        this process's resident set size (RSS), in bytes
    resident_bytes(pid)     another process's (a worker of the disaggregated pair)

The KV cache's share is `ModelRunner.kv_cache_bytes` (the bytes of the cache's tensors); each
engine's `memory()` puts the two side by side, and the server's /healthz, /api/engine and
/metrics show that dict.
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
