#!/usr/bin/env bash
# GPU check of the engine's fast path (docs/gpu.md), under 8 minutes on one GPU, no network:
#   1. scripts/gpu_check.py: every target row (model and engine step, decode step, lesson, baselines) -> OUT.json
#   2. scripts/gpu_live_check.py: the live server, 8 streaming chats while long documents arrive -> OUT.live.json
# Part 1 needs torch, transformers and triton. Part 2 also needs the web stack (not gradio): where it is
# missing, set BATCHSCOPE_WHEELS to a folder of wheels (docs/gpu.md) and they are installed from it.
# Usage: scripts/gpu_check.sh [OUT.json] [gpu_check.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
shift || true
timeout 330 python3 scripts/gpu_check.py --out "$out" --deadline 270 "$@" || echo "gpu_check.py ended with $?" >&2
if [ -n "${BATCHSCOPE_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --find-links "$BATCHSCOPE_WHEELS" \
    fastapi uvicorn websockets httpx openai prometheus-client segno pydantic
fi
if python3 -c "import fastapi, uvicorn, websockets, httpx, openai, prometheus_client, segno" 2>/dev/null; then
  timeout 140 python3 scripts/gpu_live_check.py --out "${out%.json}.live.json" || echo "gpu_live_check.py ended with $?" >&2
else
  echo "live-server check skipped: the web stack is not installed (set BATCHSCOPE_WHEELS)" >&2
fi
