#!/usr/bin/env bash
# Install batchscope with its test extras and run the whole suite (including the packaging test, which
# builds the wheel, installs it into a fresh virtual environment and serves from another directory).
set -euo pipefail
cd "$(dirname "$0")/.."
# a pinned torch resolves to the CPU build where a local wheel is offered; an unpinned one can pull
# the multi-GB CUDA build, so install it first, and only when it is missing
python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[dev]"
set +e
python3 -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
