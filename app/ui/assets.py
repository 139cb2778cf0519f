"""The page's static assets, shared by every way of serving it (the Gradio page in app/ui/page.py, the
classroom pages in app/ui/room_pages.py, the leaderboard, and the chart-only page of app/ui/plain_page.py):
no Gradio here.

static/*.js are ES modules that import what they use; a page loads one entry module (main.js, or
leaderboard.js) and the browser follows the imports, so there is no load order to keep. An import map
gives every module a URL with its content hash, so a new deploy is never served stale from a cache.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent.parent / "static"
STATIC_URL = "/static/batchscope"     # Gradio serves its own assets under /static/js, /static/fonts, ...


def versioned(name: str, base: str = STATIC_URL) -> str:
    """The URL of static/<name> (served at `base`) with its content hash: a changed file gets a new URL."""
    digest = hashlib.sha1((STATIC / name).read_bytes()).hexdigest()[:10]
    return f"{base}/{name}?v={digest}"


def module_tags(entry: str, base: str = STATIC_URL) -> str:
    """An import map from each module's plain URL (what an `import "./x.js"` resolves to) to its versioned
    one, then the entry module."""
    modules = sorted(p.relative_to(STATIC).as_posix() for p in STATIC.rglob("*.js"))
    imports = {f"{base}/{name}": versioned(name, base) for name in modules}
    return (f'<script type="importmap">{json.dumps({"imports": imports}, indent=1)}</script>\n'
            f'<script type="module" src="{versioned(entry, base)}"></script>')


def head_html() -> str:
    """<head> additions: the stylesheet and the chart's modules."""
    return f'<link rel="stylesheet" href="{versioned("style.css")}">\n' + module_tags("main.js")


def stage_html() -> str:
    """The lecturer's stage: the engine controls, then the chart and the metrics every role shares."""
    caption = '<div class="bs-lesson-now" data-testid="lesson-caption" aria-live="polite" hidden></div>\n'
    parts = [(STATIC / name).read_text() for name in ("controls.html", "chart.html", "why.html")]
    parts.insert(1, caption)                # the pressed lesson's caption, just above the chart
    return '<div id="bs-stage" class="bs-stage" data-testid="stage" data-role="lecturer">\n' + "".join(parts) + "</div>"
