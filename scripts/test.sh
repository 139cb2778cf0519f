#!/usr/bin/env bash
# Install batchscope with its test extras and run the whole suite (including the packaging test, which
# builds the wheel, installs it into a fresh virtual environment and serves from another directory).
set -euo pipefail
cd "$(dirname "$0")/.."
# a pinned torch resolves to the CPU build where a local wheel is offered; an unpinned one can pull
# the multi-GB CUDA build, so install it first, and only when it is missing
python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[dev]"
# The suite runs in pytest-xdist workers, each with one torch thread (the servers the tests start
# inherit it): on its own a worker keeps about half a core busy, as much of its time is spent waiting on
# servers, browsers and subprocesses. Default: two workers a core this process may use, at most 6; and
# at most one per 5 GB of memory, as each worker holds models (an fp32 default model is 1.5 GB with its
# kernel's copy of the weights) and starts servers and disaggregated pairs: 4 workers on 24 GB peaked at
# 15 GB in use (docs/results.md, the test suite). BATCHSCOPE_TEST_WORKERS=N sets N; 0 runs everything in
# this one process.
cores=$(nproc); mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 64)
by_cores=$(( 2 * cores < 6 ? 2 * cores : 6 )); by_mem=$(( mem_gb / 5 > 1 ? mem_gb / 5 : 1 ))
workers="${BATCHSCOPE_TEST_WORKERS:-$(( by_cores < by_mem ? by_cores : by_mem ))}"
# axe-core (pinned in tests/browser.py) for the accessibility checks of the browser tests, into the
# git-ignored .axe/; without npm, tests/test_browser_a11y.py installs it when it runs, or says why not
if command -v npm >/dev/null 2>&1; then python3 -c "from tests.browser import install_axe; install_axe()"; fi
# lint and import order first (pyproject.toml's [tool.ruff]): a lint error fails the run before the tests
python3 -m ruff check .
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
