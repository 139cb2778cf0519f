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


# ---- import circles, read from the code's own ast ------------------------------------------------

PACKAGES = ["engine", "app", "demos", "integrations"]


def _module_files() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for p in (ROOT / top).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_edges() -> dict[str, set[str]]:
    """module -> the project's modules it imports, counting every import statement: at the top, inside
    functions, under `if TYPE_CHECKING:` and in `try` blocks alike."""
    import ast
    files = _module_files()
    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:          # `import a.b.c` names a.b.c; an attribute names its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod].add(t)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    import sys as _sys
    _sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_edges_count_imports_inside_functions_and_type_checking_blocks():
    edges = import_edges()
    assert "engine.outputs.records" in edges["integrations.vllm.recorder"]
    assert "engine.scheduling.sequence" in edges["engine.scheduling.policy"]      # under TYPE_CHECKING


def test_no_import_circle_in_engine_app_demos_or_integrations():
    found = circles(import_edges())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_core_line_count_in_the_docs_is_the_codes():
    """docs/architecture.md quotes the core's size as scripts/core_lines.py counts it, to the line: one
    number for one thing (a change to the core updates the sentence)."""
    import re
    sys.path.insert(0, str(ROOT / "scripts"))
    from core_lines import CORE, core_lines
    said = re.search(r"\*\*([\d,]+) lines of code\*\* \(([\d,]+) with docstrings",
                     (ROOT / "docs" / "architecture.md").read_text())
    assert said, "docs/architecture.md no longer quotes the core's size"
    quoted = [int(x.replace(",", "")) for x in said.groups()]
    counted = [sum(core_lines().values()), sum(len((ROOT / f).read_text().splitlines()) for f in CORE)]
    assert quoted == counted, f"docs say {quoted} lines (code, all), scripts/core_lines.py counts {counted}"
