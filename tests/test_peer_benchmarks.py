"""The field's benchmark clients, unchanged, against a real batchscope server on loopback: guidellm, aiperf
and vLLM's `bench serve` each finish a short concurrent run with every request answered. Optional: they
are not dependencies (each pulls packages that clash with this project's pins, so each lives in a virtual
environment of its own); a test is skipped where its client is not found (guidellm, aiperf: on PATH or in
$GUIDELLM / $AIPERF; vLLM: scripts/install_vllm.sh's environment, which CI prepares, so CI runs that one)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

pytestmark = [pytest.mark.server, pytest.mark.peers]


def client(name: str) -> str:
    path = os.environ.get(name.upper()) or shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed (pip install {name} in a virtual environment; set ${name.upper()})")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny random model behind the whole app (default limits), served by uvicorn on a free port."""
    import uvicorn

    from app import EngineService, ServerConfig, create_app
    from engine import EngineConfig
    from tests.helpers import save_tiny_model
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))
    service = EngineService(EngineConfig(model=str(folder), kv_cache_gb=0.05, cpu_threads=1), ServerConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", proxy_headers=False))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", folder, service
    service.begin_shutdown()
    srv.should_exit = True
    thread.join(30)
    sock.close()


def run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1"}     # (aiperf reads a local tokenizer folder only when online)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_guidellm_finishes_a_concurrent_run_without_errors(server, tmp_path):
    url, folder, service = server
    out = tmp_path / "guidellm.json"
    run([client("guidellm"), "run", f"--backend=kind=openai_http,target={url}",
         "--profile=kind=concurrent,streams=4", "--data=kind=synthetic_text,prompt_tokens=64,output_tokens=8",
         "--constraint=kind=max_requests,count=8", f"--tokenizer=kind=hf_auto,model={folder}",
         f"--output=kind=json,path={out}", "--disable-console-interactive"], tmp_path)
    (bench,) = json.loads(out.read_text())["benchmarks"]
    counts = bench["scheduler_state"]
    assert (counts["successful_requests"], counts["errored_requests"], counts["cancelled_requests"]) == (8, 0, 0)


def test_aiperf_finishes_a_concurrent_run_without_errors(server, tmp_path):
    url, folder, service = server
    run([client("aiperf"), "profile", "--model", service.model_name, "--url", url, "--endpoint-type", "chat",
         "--streaming", "--concurrency", "4", "--request-count", "8", "--synthetic-input-tokens-mean", "64",
         "--output-tokens-mean", "8", "--tokenizer", str(folder), "--output-artifact-dir", str(tmp_path / "aiperf"),
         "--no-auto-plot", "--ui-type", "simple"], tmp_path)
    report = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 8 and report["error_summary"] == [] and not report["was_cancelled"]


def test_the_side_by_side_script_measures_a_server(server):
    """demos/vllm/peers.py's client on a real server: every request answered, its numbers filled in."""
    import asyncio

    from demos.vllm import peers as bench_peers
    url, _, service = server
    m = asyncio.run(bench_peers.level(url, concurrency=2, requests=3, prompt_tokens=16, output_tokens=5, salt=1,
                                      model=service.model_name))
    assert m["tok_s"] > 0 and m["ttft"][0] is not None and 0 < m["ttft"][0] <= m["ttft"][1]
    assert m["itl"][0] is not None and m["itl"][0] <= m["itl"][1]
    assert "not installed" in bench_peers.row("vLLM-CPU", 8, None, "not installed")
    assert bench_peers.median_of([m, m, m]) == {"tok_s": m["tok_s"], "ttft": m["ttft"], "itl": m["itl"]}


def vllm_python_or_skip() -> str:
    """vLLM's own environment (scripts/install_vllm.sh; $BATCHSCOPE_VLLM_PYTHON names another)."""
    from demos.vllm import server as vllm_server
    path = vllm_server.vllm_python()
    if path is None:
        pytest.skip("vLLM is not installed (bash scripts/install_vllm.sh)")
    return str(path)


# `vllm bench serve`, exactly: the console command's own two calls (vllm-cpu's `vllm` script cannot start:
# it looks up its version under the name `vllm`, and the CPU build's metadata is under `vllm-cpu`)
VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def test_vllm_bench_serve_finishes_a_concurrent_run_without_errors(server, tmp_path):
    """vLLM's own benchmark client (`vllm bench serve`), its chat backend, streaming, 4 at a time."""
    url, folder, service = server
    run([vllm_python_or_skip(), "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat",
         "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", service.model_name,
         "--tokenizer", str(folder), "--dataset-name", "random", "--random-input-len", "64",
         "--random-output-len", "8", "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"], tmp_path)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["completed"] == 8 and report.get("failed", 0) == 0
    assert report["total_output_tokens"] == 8 * 8


def test_a_vllm_python_that_is_not_there_is_named_not_a_traceback(tmp_path):
    """demos/vllm/peers.py --vllm-python: a path that does not exist, or a Python without vllm, is refused
    before any server starts, with the path in the message."""
    import sys

    from demos.vllm.peers import vllm_python
    with pytest.raises(ValueError, match="no-such-python"):
        vllm_python(str(tmp_path / "no-such-python"))
    with pytest.raises(ValueError, match="cannot import vllm"):
        vllm_python(sys.executable if not _imports_vllm(sys.executable) else str(tmp_path / "x"))
    run = subprocess.run([sys.executable, "-m", "demos.vllm.peers", "--vllm-python", str(tmp_path / "no-such-python")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no-such-python" in run.stderr and "Traceback" not in run.stderr, run.stderr


def _imports_vllm(python: str) -> bool:
    return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
