#!/usr/bin/env bash
# Prepare the field's benchmark clients, guidellm and aiperf, each in a virtual environment of its own, for
# tests/test_peer_benchmarks.py (which finds them through $GUIDELLM and $AIPERF) and for side-by-side runs.
#   bash scripts/install_peers.sh            (makes .venv-guidellm and .venv-aiperf in the repository root)
# Neither is a dependency of batchscope: each pins packages (transformers, pydantic, rich, ...) that clash
# with this project's own, and with each other's, so each lives apart.
# Steps, and why each is needed:
#   1. guidellm: it requires an unpinned torch (for its audio/vision data paths, unused here), which
#      resolves to the multi-GB CUDA build; torch is pinned first, and again beside guidellm, so that the
#      CPU build is taken where one is offered (a client needs no GPU).
#      GUIDELLM_VERSION (default 0.8.1) is tried first; if that pin does not install, the newest that does.
#   2. aiperf: the newest that installs (AIPERF_VERSION pins one). It pulls no torch (checked: 0.13.0).
#      Offline use: give both a local model folder as tokenizer. guidellm runs with HF_HUB_OFFLINE=1;
#      aiperf (0.13.0) must run WITHOUT it: offline mode sends even a local folder to snapshot_download,
#      which rejects the path (HFValidationError); online mode reads the folder and never calls the Hub.
#   3. each console command is run once (--help), so that a broken install fails here.
# At the end the two `export` lines for the tests are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
AIPERF_VERSION="${AIPERF_VERSION:-}"

venv() {  # venv DIR: a virtual environment with a current pip
    [ -x "$1/bin/python" ] || python3 -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip
}

# 1. guidellm, torch pinned to the CPU build
G=.venv-guidellm
venv "$G"
"$G/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
"$G/bin/python" -m pip install --quiet "guidellm==$GUIDELLM_VERSION" "torch==$TORCH_VERSION" \
    || { echo "guidellm==$GUIDELLM_VERSION did not install; taking the newest that does" >&2
         "$G/bin/python" -m pip install --quiet guidellm "torch==$TORCH_VERSION"; }
"$G/bin/guidellm" --help >/dev/null

# 2. aiperf
A=.venv-aiperf
venv "$A"
"$A/bin/python" -m pip install --quiet "aiperf${AIPERF_VERSION:+==$AIPERF_VERSION}"
"$A/bin/aiperf" --help >/dev/null

# 3. what was installed
"$G/bin/python" -c "import importlib.metadata as m, torch; print('guidellm', m.version('guidellm'), 'torch', torch.__version__)"
"$A/bin/python" -c "import importlib.metadata as m; print('aiperf', m.version('aiperf'))"
echo "export GUIDELLM=$ROOT/$G/bin/guidellm"
echo "export AIPERF=$ROOT/$A/bin/aiperf"
