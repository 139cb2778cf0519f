"""The disaggregated pair's processes die with the process that started them.

A pair (engine/disagg/router.py) starts a fork server, two workers and multiprocessing's resource tracker.
Here a pair runs in a child process of its own (a small script), which the test kills without warning
(SIGKILL, as the OOM killer does) or asks to stop (SIGTERM, the default action: no Python clean-up runs).
Every process the script had started must then be gone within a few seconds, or it would hold its copy of the
model (about 1 GB a worker on the default model) until someone finds it."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = textwrap.dedent("""
    import sys, time
    from engine import EngineConfig
    from engine.disagg.router import DisaggregatedEngine
    eng = DisaggregatedEngine(EngineConfig(model=sys.argv[1], dtype="float32", kv_cache_gb=0.01,
                                           max_model_len=256, block_size=16))
    print("workers", *(w["pid"] for w in eng.stats()["workers"].values()), flush=True)
    time.sleep(600)
""")


def descendants(pid: int) -> set[int]:
    """Every living process below pid, from /proc's children lists of each of its threads (Linux)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            for k in map(int, kids):
                if k not in found:
                    found.add(k)
                    todo.append(k)
    return found


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; a zombie is dead (it holds no memory, only its exit status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except (FileNotFoundError, ProcessLookupError):
        return "?"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_process_of_the_pair_outlives_its_parent(sig, tiny_model):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_model)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line.startswith("workers"), f"the pair did not start: {line!r}\n{parent.stderr.read()}"
        workers = {int(p) for p in line.split()[1:]}
        family = descendants(parent.pid)
        # the fork server, both workers (its children) and the resource tracker
        assert workers <= family and len(family) >= 3, (workers, family)
        parent.send_signal(sig)
        parent.wait(30)
        deadline = time.monotonic() + 10
        while (left := {p for p in family if alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, "outlived their parent: " + "; ".join(f"{p} {command(p)}" for p in sorted(left))
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for p in descendants(parent.pid) | (locals().get("family") or set()):
            if alive(p):
                os.kill(p, signal.SIGKILL)              # a failed run leaves nothing behind either
