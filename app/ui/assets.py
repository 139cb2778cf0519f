"""The page's static assets, shared by every way of serving it (the Gradio page in app/ui/page.py, the
classroom pages in app/ui/room_pages.py, and the chart-only page of app/ui/plain_page.py): no Gradio here."""
from __future__ import annotations

import hashlib
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent.parent / "static"
SCRIPTS = ["record.js", "i18n.js", "palette.js", "socket.js", "layout.js", "draw.js", "interact.js", "controls.js",
           "metrics.js", "analysis.js", "kvmap.js", "why.js", "room.js", "lesson.js", "main.js", "whatif.js"]
STATIC_URL = "/static/batchscope"     # Gradio serves its own assets under /static/js, /static/fonts, ...


def head_html() -> str:
    """<head> additions: the stylesheet and the chart scripts, versioned so a new deploy is never stale."""
    def url(name):
        digest = hashlib.sha1((STATIC / name).read_bytes()).hexdigest()[:10]
        return f"{STATIC_URL}/{name}?v={digest}"
    tags = [f'<link rel="stylesheet" href="{url("style.css")}">']
    tags += [f'<script src="{url(name)}"></script>' for name in SCRIPTS]
    return "\n".join(tags)


def stage_html() -> str:
    """The lecturer's stage: the engine controls, then the chart and the metrics every role shares."""
    caption = '<div class="bs-lesson-now" data-testid="lesson-caption" aria-live="polite" hidden></div>\n'
    parts = [(STATIC / name).read_text() for name in ("controls.html", "chart.html", "why.html")]
    parts.insert(1, caption)                # the pressed lesson's caption, just above the chart
    return '<div class="bs-stage" data-testid="stage" data-role="lecturer">\n' + "".join(parts) + "</div>"
