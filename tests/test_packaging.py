"""batchscope as a user installs and runs it: the wheel, the `batchscope` command, and `python app.py`
exactly as Hugging Face Spaces starts it."""
from __future__ import annotations

import os
import re
import shutil
import site
import socket
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
import tomllib

from tests.helpers import Served

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("engine", "app", "demos", "static")      # the folders the wheel carries, every file in them
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}


def _name(requirement: str) -> str:
    """'torch>=2.5' -> 'torch'; 'prometheus-client' and 'prometheus_client' are one package (PEP 503)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def test_requirements_txt_names_the_runtime_dependencies_of_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [x.split("#")[0].strip() for x in (ROOT / "requirements.txt").read_text().splitlines()]
    reqs = [x for x in lines if x]
    assert sorted(map(_name, reqs)) == sorted(map(_name, deps)), \
        "a Space installs requirements.txt, `pip install .` reads pyproject.toml: keep them the same"
    assert sorted(reqs) == sorted(deps), "same packages, but the version bounds differ"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a clean copy: an in-tree build/ folder keeps stale files that would ship in the wheel
    source = out / "source"
    # (every hidden folder at the top is left out: .git, caches, and virtual environments such as the
    # vLLM one, 3.4 GB, which this copy once took most of its time over)
    skip = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*.pyc", "out", "tests", "docs")
    shutil.copytree(ROOT, source, ignore=lambda folder, names: skip(folder, names) | (
        {n for n in names if n.startswith(".")} if Path(folder) == ROOT else set()))
    # no build isolation: setuptools is installed, and CI must not need an index to build
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(source)], check=True, cwd=out)
    (whl,) = out.glob("batchscope-*.whl")
    return whl


def test_the_wheel_carries_every_file_of_the_app_and_the_command(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [str(p.relative_to(ROOT)) for folder in SHIPPED for p in (ROOT / folder).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
               and str(p.relative_to(ROOT)) not in names]
    assert not missing, f"files the wheel leaves out: {missing}"
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "batchscope = app.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _clean_env(**extra) -> dict:
    # no flags from the environment (BATCHSCOPE_CACHE, where the model lives, is not a flag)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BATCHSCOPE_", "PYTHON", "GRADIO_")) or k == "BATCHSCOPE_CACHE"}
    return {**env, "BATCHSCOPE_KV_CACHE_GB": "0.1", "NO_PROXY": "*", **extra}


def _check_page_static_and_chat(url: str):
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
        assert http.get("/healthz").json()["status"] == "ok"
        page = http.get("/")
        assert page.status_code == 200 and "/static/batchscope/draw.js" in page.text
        script = http.get("/static/batchscope/draw.js")
        assert script.status_code == 200 and script.text == (ROOT / "static" / "draw.js").read_text()
        reply = http.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] >= 1


@pytest.mark.packaging
@pytest.mark.server
@pytest.mark.timeout(420)
def test_the_wheel_serves_the_whole_app_from_another_directory(wheel, tmp_path):
    """A fresh virtual environment with only the wheel installed. torch and the other heavy dependencies
    come from the environment these tests run in (a venv or not), named by a .pth file, so this stays
    fast and offline; plain paths, so that environment's own .pth files (an editable batchscope) stay out."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, command = venv / "bin" / "python", venv / "bin" / "batchscope"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(purelib) / "tests-environment.pth").write_text("".join(f"{p}\n" for p in ours if Path(p).is_dir()))
    # --no-index: every dependency must already be satisfied, or the install fails and names it
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                    str(wheel)], check=True, cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import app, engine, static; print(engine.__file__); "
                            "print(app.__file__); print(list(static.__path__)[0])"],
                           cwd=elsewhere, env=_clean_env(), capture_output=True, text=True, check=True)
    for path in where.stdout.split():
        assert Path(path).is_relative_to(venv), f"{path} is not the wheel's copy (an editable install shadows it)"
    help_text = subprocess.run([str(command), "serve", "--help"], cwd=elsewhere, env=_clean_env(),
                               capture_output=True, text=True, check=True).stdout
    assert "batchscope serve" in help_text and "--step-delay" in help_text
    server = Served([str(command), "serve", "--port", "0"], cwd=elsewhere, env=_clean_env())
    try:
        _check_page_static_and_chat(server.url)
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.server
@pytest.mark.timeout(300)
def test_python_app_py_runs_as_spaces_starts_it():
    port = _free_port()
    env = _clean_env(GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port))
    server = Served([sys.executable, "app.py"], cwd=ROOT, env=env)
    try:
        assert server.url == f"http://127.0.0.1:{port}"
        _check_page_static_and_chat(server.url)
    finally:
        server.stop()
