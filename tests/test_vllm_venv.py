"""Runs the vLLM recorder's tests (tests/test_vllm_recorder.py, tests/test_vllm_dp.py) in the vLLM virtual
environment that scripts/install_vllm.sh prepares (.venv-vllm, or the python named by BATCHSCOPE_VLLM_PYTHON): vLLM
pins its own packages, so it lives beside the project's environment, not in it.

Skipped only where no such environment exists, or where this environment has vLLM itself (then
those tests run here directly).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def vllm_python() -> Path | None:
    named = os.environ.get("BATCHSCOPE_VLLM_PYTHON")
    path = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is here: the recorder tests run directly")
def test_recorder_tests_pass_in_the_vllm_environment():
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM environment: bash scripts/install_vllm.sh makes one")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BATCHSCOPE_RECORDS_PORT": "off"}
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_vllm_recorder.py",
                          "tests/test_vllm_dp.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, f"the recorder's tests failed in {python}:\n{tail}"
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail
