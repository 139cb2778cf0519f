#!/usr/bin/env bash
# Install batchscope with its test extras and run the whole suite (including the packaging test, which
# builds the wheel, installs it into a fresh virtual environment and serves from another directory).
set -euo pipefail
cd "$(dirname "$0")/.."
# a pinned torch resolves to the CPU build where a local wheel is offered; an unpinned one can pull
# the multi-GB CUDA build, so install it first, and only when it is missing
python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[dev]"
# BATCHSCOPE_TEST_WORKERS=N runs the suite in N pytest-xdist workers, each with one torch thread (the
# servers the tests start inherit it): on its own the suite keeps about one core busy, so on 2 cores 3
# workers take about 7.5 minutes instead of 13.5. Not the default: under that load the lecture test's
# scripted users can join a step late and its step-for-step comparison then fails (1 run in 4).
workers="${BATCHSCOPE_TEST_WORKERS:-0}"
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
