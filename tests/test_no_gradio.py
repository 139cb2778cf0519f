"""Where gradio is not installed (a GPU machine often has none) `python -m app` still serves: the API,
/ws/steps, /metrics and the chart page, which says the chat panels need gradio. The server runs in a
subprocess whose imports of gradio fail, so this machine's gradio stays out of it."""
import json
import sys
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from tests.helpers import Served, save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

NO_GRADIO = r"""
import importlib.abc, runpy, sys

class NoGradio(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "gradio":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoGradio())
sys.argv = ["python -m app", *sys.argv[1:]]
runpy.run_module("app", run_name="__main__", alter_sys=True)
"""


def test_server_without_gradio(tmp_path):
    folder = save_tiny_model("llama", tmp_path / "llama")
    args = ["--model", str(folder), "--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.05",
            "--cpu-threads", "1", "--port", "0"]
    server = Served([sys.executable, "-c", NO_GRADIO, *args], cwd=ROOT, env=None,
                    pattern=r"serving .* at (http://127\.0\.0\.1:\d+)")
    url, output = server.url, server.output
    try:
        assert any("gradio is not installed" in x for x in output)
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
            page = http.get("/")
            assert page.status_code == 200 and 'data-testid="needs-gradio"' in page.text
            assert "chat panels need gradio" in page.text and 'data-role="lecturer"' in page.text
            assert 'data-testid="legend"' in page.text and "main.js" in page.text
            assert http.get("/static/batchscope/main.js").status_code == 200
            assert http.get("/projector").status_code == 200
            assert http.get("/healthz").json()["status"] == "ok"
            reply = http.post("/v1/chat/completions", json={"model": "llama", "max_tokens": 3, "temperature": 0,
                                                            "messages": [{"role": "user", "content": "Hi"}]})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
            with connect(url.replace("http", "ws") + "/ws/steps", open_timeout=30) as ws:
                first = json.loads(ws.recv(timeout=30))
            assert first["type"] == "snapshot" and any(r["type"] == "step" for r in first["records"])
            metrics = http.get("/metrics")
            assert metrics.status_code == 200 and "# TYPE" in metrics.text
    finally:
        server.stop()
