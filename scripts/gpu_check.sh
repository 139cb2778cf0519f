#!/usr/bin/env bash
# GPU check of the engine's fast path (docs/gpu.md): one JSON file of results, under 8 minutes on one GPU.
# Needs only torch, transformers and triton; no network. Usage: scripts/gpu_check.sh [OUT.json] [--quick ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
shift || true
timeout 470 python3 scripts/gpu_check.py --out "$out" "$@"
