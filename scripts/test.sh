#!/usr/bin/env bash
# Install batchscope with its test extras and run the whole suite (including the packaging test, which
# builds the wheel, installs it into a fresh virtual environment and serves from another directory).
set -euo pipefail
cd "$(dirname "$0")/.."
# a pinned torch resolves to the CPU build where a local wheel is offered; an unpinned one can pull
# the multi-GB CUDA build, so install it first, and only when it is missing
python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[dev]"
# Workers (pytest-xdist): on its own the suite keeps about one core busy, as its servers, browsers and
# subprocesses wait on each other; one worker more than there are cores, each with one torch thread
# (the tests' engines and the servers they start inherit it), keeps every core working.
# BATCHSCOPE_TEST_WORKERS=0 runs one process with torch's own thread count.
cores=$(nproc); workers="${BATCHSCOPE_TEST_WORKERS:-$(( cores < 5 ? cores + 1 : 6 ))}"   # at most 6: each loads models
set +e
if [ "$workers" -gt 0 ]; then
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python3 -m pytest -q -n "$workers" --dist worksteal --durations=15 "$@"
else
    python3 -m pytest -q --durations=15 "$@"
fi
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
