"""Building, probing and loading the CPU library (cpu_kernels.cpp), once per machine.

build   the system's C++ compiler (g++, c++ or clang++; $CXX first) for this CPU (-march=native, or
        $BATCHSCOPE_CPU_ARCH: x86-64-v3 builds what a CPU with AVX2 and FMA but no AVX-512 gets), into
        the batchscope cache under a name that hashes the source, the flags, the compiler, torch's OpenMP
        runtime and the CPU's feature flags, so a cache folder shared by machines with other CPUs never
        loads code built for another.
ready   build if missing, then probe, on a lock beside the library: processes starting at once on a fresh
        cache (a test run's workers, servers started together) take turns, so one builds and probes and
        the others load its file.
probe   the new library is first loaded and each of its ops called on small inputs in a child process
        (engine/kernels/probe.py): a CPU that reports AVX-512 while its hypervisor disables it dies of
        SIGILL there, not in the server. A probe that passed leaves a stamp beside the library, so it runs
        once per build; one that died is logged with its signal and the op it was in, and the engine
        takes the plain path.
OpenMP  the library links the OpenMP runtime torch ships (torch/lib/libgomp*.so*) by its path, so one
        process has one OpenMP pool: pip's torch may rename its copy (libgomp-<hash>.so.1), and a library
        linked with plain -fopenmp would then load the system's libgomp beside it, a second pool of threads
        on the same cores. Where torch ships none, -fopenmp (the system's).
"""
from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger("batchscope.engine")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")   # includes the sections, one file each (*.h beside it)


def source_text() -> str:
    """The library's whole source, its sections included: what names a build."""
    return "".join(p.read_text() for p in [SOURCE, *sorted(SOURCE.parent.glob("*.h"))])

# -ffast-math without -ffinite-math-only: the compiler still vectorises exp (glibc's libmvec, declared at the
# top of cpu_kernels.cpp) and reorders the sums, but may not assume that no value is NaN or infinite, which
# the engine relies on to fail a request whose logits went non-finite (tests/test_kernel_ops.py). Given only
# when compiling, not when linking, so the library does not switch the process to flush-to-zero.
COMPILE = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
           "-fassociative-math", "-freciprocal-math", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=c++17"]
# the build variant the fuzz runs under once; -O1 (after COMPILE's -O3, so it wins) as ASan's own documentation
# advises: every access is still instrumented, and the build takes a third of -O3's time
ASAN = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]


def torch_openmp() -> Path | None:
    """The OpenMP runtime torch itself loads (its libgomp in torch/lib), or None where it ships none."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(p for p in lib.glob("libgomp*.so*") if p.is_file())
    return found[0] if found else None


def link_flags(sanitize: bool = False) -> list[str]:
    gomp = torch_openmp()
    omp = ["-fopenmp"] if gomp is None else [str(gomp), f"-Wl,-rpath,{gomp.parent}"]
    return ["-shared", *(ASAN if sanitize else []), *omp]


def compile_flags(sanitize: bool = False) -> list[str]:
    return [f"-march={os.environ.get('BATCHSCOPE_CPU_ARCH', 'native')}", *COMPILE, *(ASAN if sanitize else [])]


def library_path(cxx: str, cpu_flags: str, root: Path, sanitize: bool = False) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [source_text(), *compile_flags(sanitize), *link_flags(sanitize), version, cpu_flags]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return root / "kernels" / f"cpu_kernels-{'asan-' if sanitize else ''}{key}.so"


def ready(cxx: str, out: Path) -> str | None:
    """Build `out` if it is missing, then probe it: None if it may be loaded, else why not. On a lock beside
    it, so processes that start at once build and probe it once: the others wait, then find the file and
    the probe's stamp."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(out.with_suffix(".lock")):
        if not out.exists():
            build(cxx, out)
        return probe(out)


@contextmanager
def one_at_a_time(lock: Path):
    """An exclusive POSIX flock on `lock`, so processes sharing the cache take turns (this library's build, the
    default model's preparation, engine/weights/loader.py). Where there is none (Windows), no lock: each
    process then makes its own copy and the last rename wins, whole."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(cxx: str, out: Path, sanitize: bool = False):
    """Compile, then link, into a temporary name beside `out`, then rename, so no process loads a half-written
    file (ready() makes processes take turns; without a lock each finishes its own and the last rename wins)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "cpu_kernels.o", Path(tmp) / out.name
        for cmd in ([cxx, *compile_flags(sanitize), "-c", str(SOURCE), "-o", str(obj)],
                    [cxx, str(obj), *link_flags(sanitize), "-o", str(lib)]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(f"{' '.join(cmd[:2])} ... exited {r.returncode}: {r.stderr.strip()[-500:]}")
        os.replace(lib, out)


def probe(path: Path) -> str | None:
    """Load `path` and call each op in a child process; None if it passed, else why it did not."""
    stamp = path.with_suffix(".probed")
    if stamp.exists():
        return None
    env = {k: v for k, v in os.environ.items() if k != "BATCHSCOPE_CPU_KERNEL"}
    try:
        r = subprocess.run([sys.executable, "-m", "engine.kernels.probe", str(path)], capture_output=True, text=True,
                           timeout=300, env=env, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        return "the probe did not finish in 300 s"
    last = (r.stdout.strip().splitlines() or ["loading the library"])[-1]
    if r.returncode < 0:
        return f"the probe child died of {signal.Signals(-r.returncode).name} in {last}"
    if r.returncode:
        return f"the probe child exited {r.returncode} in {last}: {r.stderr.strip()[-300:]}"
    stamp.write_text(r.stdout)
    return None
