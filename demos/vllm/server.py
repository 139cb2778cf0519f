"""A real vLLM server on loopback, with batchscope's recording scheduler: for the end-to-end test, the
side-by-side runs of demos.compare and demos.bench (--vllm-start) and demos.vllm.recorder_tokens.

    python -m demos.vllm.server [PORT [VLLM FLAGS...]]      # serves the default model until interrupted
    python -m demos.vllm.server 8000 --max-num-batched-tokens 256 --optimization-level 0

It runs in the vLLM virtual environment (scripts/install_vllm.sh) from a copy of the default model's
folder in which the tied embedding is stored under `model.embed_tokens.weight` as well: batchscope's
prepared folder stores it only as `lm_head.weight` (the file's metadata names the alias), which
vLLM's loader does not follow, so it would embed with zeros and emit token 0 forever.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SERVED_NAME = "SmolLM2-135M-Instruct"


def vllm_python() -> Path | None:
    named = os.environ.get("BATCHSCOPE_VLLM_PYTHON")
    path = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def vllm_model_folder(source: Path, dest: Path) -> Path:
    """dest: source's files, with the embedding stored under both names (once; reused after)."""
    from safetensors.torch import load_file, save_file
    if (dest / "model.safetensors").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, dest / f.name)
    tensors = load_file(source / "model.safetensors")
    if "model.embed_tokens.weight" not in tensors:
        tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, dest / "model.safetensors.tmp",
              metadata={"format": "pt"})
    os.replace(dest / "model.safetensors.tmp", dest / "model.safetensors")
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, port: int, records_port: int, log: Path, *extra: str, kv_cache_gb: int = 2,
          recorder: bool = True, env: dict | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server, with the recording scheduler unless recorder=False; returns at once (it
    starts in about a minute with -O0, several when it compiles). extra: more vLLM flags (a later flag
    wins, so --max-model-len may be given again). kv_cache_gb: whole GiB (the CPU build's unit). env:
    more environment variables for vLLM."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "BATCHSCOPE_RECORDS_PORT": str(records_port), "NO_PROXY": "*", **(env or {})}
    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "4096",
           "--host", "127.0.0.1", "--port", str(port)]
    if recorder:
        cmd += ["--scheduler-cls", "integrations.vllm.RecordingScheduler"]
    return subprocess.Popen(cmd + list(extra), cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 30):
    """Ends the server and its engine processes (their own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float = 900) -> float:
    """Seconds until /v1/models answers; raises with the log's tail if vLLM exits or takes too long."""
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2, trust_env=False).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vLLM did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def folder_for(model: str | None = None) -> Path:
    """batchscope's model folder (the default model unless named), copied once into one vLLM can load."""
    from engine.weights.loader import cache_dir, resolve_model
    source = Path(resolve_model(model))
    name = SERVED_NAME if model is None else source.name
    return vllm_model_folder(source, cache_dir() / f"vllm-{name}")


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    folder = folder_for()
    log = Path(tempfile.gettempdir()) / f"vllm-{port}.log"
    proc = start(folder, port, 8765, log, *sys.argv[2:])
    print(f"vLLM starting on port {port}, records on 8765 (log: {log}); "
          f"ready after {wait_ready(proc, port, log):.0f} s")
    proc.wait()
