"""The arena's leaderboard, for the presenter: the ranked results of `batchscope arena --rank` and the
winner's run replayed on the chart.

    /leaderboard         pick a report JSON (out/arena.json): the ranking of each workload, a replay button
    /leaderboard/chart   the chart alone, offline: the leaderboard feeds it the winner's records

The report is read by the presenter's browser and goes nowhere else: the server stores nothing, runs
no policy and receives no file (student code runs only where `batchscope arena` is run, docs/arena.md).
Both pages hold nothing until a report is opened in them, so they need no presenter key.
"""
from __future__ import annotations

import html

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from app.ui.assets import module_tags, versioned
from app.ui.room_pages import fragment, page

# the chart page fed by the leaderboard, not by a socket: set before the entry module (static/main.js) reads it
OFFLINE = "<script>window.BS = {offline: true};</script>"


def leaderboard_html(static_url: str) -> str:
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><meta name="robots" content="noindex">
<title>batchscope · arena leaderboard</title>
<link rel="stylesheet" href="{html.escape(versioned("style.css", static_url))}">
{module_tags("leaderboard.js", static_url)}</head>
<body class="bs-room bs-leaderboard">{fragment("leaderboard.html")}</body></html>"""


def mount_leaderboard(app: FastAPI, head: str, static_url: str):
    """`head`: the chart's stylesheet and scripts (app.ui.page.head_html)."""
    @app.get("/leaderboard", response_class=HTMLResponse)
    async def leaderboard():
        return leaderboard_html(static_url)

    @app.get("/leaderboard/chart", response_class=HTMLResponse)
    async def leaderboard_chart():
        return page("replay", OFFLINE + head, "")
