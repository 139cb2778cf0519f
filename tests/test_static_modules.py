"""static/ is ES modules with no build step: every file exports what it offers and imports what it uses,
the imports name real exports and form no cycle, every module is reached from a page's one entry module,
and window.BS is only the handle main.js sets for the console and the browser tests."""
import json
import os
import re
from pathlib import Path

from app.ui.assets import STATIC, STATIC_URL, head_html

MODULES = {p.relative_to(STATIC).as_posix(): p.read_text() for p in sorted(STATIC.rglob("*.js"))}
ENTRIES = ["main.js", "leaderboard.js"]        # the chart pages (app/ui/assets.py), the leaderboard
IMPORT = re.compile(r'^import (?:\{([^}]*)\}|\* as \w+|(\w+)) from "(\.\.?/[\w./]+\.js)";', re.M)
EXPORT = re.compile(r"^export (?:async function|function|const|let) (\w+)", re.M)


def code_of(src: str) -> str:
    return re.sub(r"^\s*//.*$|\s//\s.*$", "", src, flags=re.M)


def imports_of(name: str) -> list[tuple[str, list[str]]]:
    """(module imported, the names it is asked for; "default" for a default import) of static/<name>."""
    out = []
    for names, default, spec in IMPORT.findall(MODULES[name]):
        target = (Path(name).parent / spec).as_posix().removeprefix("./")
        target = os.path.normpath(target)      # "strings/../x.js" -> "x.js"
        asked = [n.split(" as ")[0].strip() for n in names.split(",") if n.strip()] + (["default"] if default else [])
        out.append((target, asked))
    return out


def exports_of(name: str) -> set[str]:
    src = MODULES[name]
    return set(EXPORT.findall(src)) | ({"default"} if re.search(r"^export default ", src, re.M) else set())


def test_modules_import_real_exports_of_real_files():
    for name in MODULES:
        for target, asked in imports_of(name):
            assert target in MODULES, (name, target)
            assert set(asked) <= exports_of(target), (name, target, set(asked) - exports_of(target))
        assert "(function () {" not in MODULES[name], f"{name} is still a classic script"


def test_imports_form_no_cycle_and_reach_every_module():
    graph = {name: [t for t, _ in imports_of(name)] for name in MODULES}
    done, path = set(), []

    def visit(name):
        assert name not in path, "import cycle: " + " -> ".join(path[path.index(name):] + [name])
        if name in done:
            return
        path.append(name)
        for target in graph[name]:
            visit(target)
        path.pop()
        done.add(name)
    for entry in ENTRIES:
        visit(entry)
    assert done == set(MODULES), f"modules no page loads: {sorted(set(MODULES) - done)}"


def test_only_the_entry_module_touches_window_bs():
    for name, src in MODULES.items():
        code = code_of(src)
        if name == "main.js":
            assert "window.BS = handle(" in code
            continue
        # a module imports what it uses; the leaderboard drives the chart in its frame, another page
        reads = re.findall(r"(?<![\w.])(?:window\.)?BS\.\w+|window\.BS\b", code.replace("contentWindow.BS.", ""))
        assert reads == [], (name, reads)


def test_the_page_loads_one_entry_module_and_maps_every_module_to_its_version():
    head = head_html()
    modules = re.findall(r'<script type="module" src="([^"]+)"></script>', head)
    assert len(modules) == 1 and modules[0].startswith(f"{STATIC_URL}/main.js?v=")
    assert "<script src=" not in head
    imports = json.loads(re.search(r'<script type="importmap">(.*?)</script>', head, re.S).group(1))["imports"]
    assert set(imports) == {f"{STATIC_URL}/{name}" for name in MODULES}
    assert all(re.fullmatch(re.escape(plain) + r"\?v=[0-9a-f]{10}", url) for plain, url in imports.items())


def test_no_local_name_hides_an_import():
    """A local `t` in a function that also says t("key") breaks the page only when that line runs."""
    for name, src in MODULES.items():
        code = code_of(src)
        imported = {n.split(" as ")[-1].strip() for names, _, _ in IMPORT.findall(src) for n in names.split(",")
                    if n.strip()}
        for local in imported:
            n = re.escape(local)
            hides = re.search(rf"(?:\b(?:const|let|var|function)\s+{n}\b|[(,]\s*{n}\s*(?:[,)]\s*=>|\)\s*=>)"
                              rf"|,\s*{n}\s*=(?!=)|\(\s*{n}\s*\)\s*=>)", code)
            assert not hides, (name, local, hides and hides.group(0))
