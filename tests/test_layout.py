"""app/'s folders hold what their names say: the record readers load no web stack and no torch, the
replay no web stack, each folder imports only from those below it, and nothing in engine/ imports app/."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _loaded(modules: list[str]) -> set[str]:
    code = (f"import sys; import {', '.join(modules)}; "
            "print(' '.join(sorted({'torch', 'gradio', 'fastapi', 'starlette', 'uvicorn'} & set(sys.modules))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def _modules(package: str) -> list[str]:
    folder = ROOT / package.replace(".", "/")
    return [f"{package}.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]


def test_the_record_readers_need_no_web_stack_and_no_torch():
    assert _loaded(_modules("app.readers")) == set()


@pytest.mark.parametrize("package", ["app.replay"])
def test_the_replay_needs_no_web_stack(package):
    assert not _loaded(_modules(package)) & {"gradio", "fastapi", "starlette", "uvicorn"}


def test_the_engine_never_imports_the_app():
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py")
            if any(line.lstrip().startswith(("from app", "import app")) for line in p.read_text().splitlines())]
    assert not hits, hits


def test_app_top_level_holds_only_entry_points_and_config():
    top = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py", "config.py"], top


LAYERS = ["readers", "replay", "serving", "api", "ui"]     # each imports only from those before it


def test_each_folder_of_app_imports_only_from_the_folders_below_it():
    import re
    wrong = []
    for i, layer in enumerate(LAYERS):
        for f in (ROOT / "app" / layer).glob("*.py"):
            for used in re.findall(r"^\s*from app\.(\w+)", f.read_text(), re.M):
                if used in LAYERS and LAYERS.index(used) > i:
                    wrong.append(f"{f.relative_to(ROOT)} imports app.{used}")
    assert not wrong, wrong
