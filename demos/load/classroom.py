"""A long lecture: students join, chat and leave for half an hour while the lecturer presses the lessons.

    python -m demos.load.classroom                       # 30 minutes, 60 students, a lesson every 3 minutes
    python -m demos.load.classroom --minutes 3 --students 12 --lesson-every 60 --lesson-seconds 20 --settle 10 \
        --window 1 --warmup-minutes 1 --json room.json

A measurement, not a test: it is not in the suite. It starts
`python -m app` on the server's own defaults on a free 127.0.0.1 port and plays a lecture against it:
  - --students simulated students on the room's own API (POST /api/room/join, /api/room/chat,
    /api/room/leave, as the student page calls them): each joins under a name, sends a few messages
    with some seconds of thought between them, reads every reply as it streams, sometimes leaves in the
    middle of a reply, then leaves, stays away a while and joins again under a new name;
  - the lecturer's page in Chromium, which presses lesson 1, 2, ... 8 in turn every --lesson-every
    seconds; --lesson-seconds later the lecturer puts the room's settings back (POST /api/engine with
    the settings the server started with), as a lecturer does before the room chats on; the lesson
    counts as in force until --settle seconds after that (its scripted replies end);
  - the projector view in Chromium, drawing the chart;
  - once a second it reads /api/engine and the server's resident memory (the server process, and the
    server with its children: the disaggregated lesson's workers).
After --minutes it stops the students, waits for the engine to empty, and checks:
  - no 5xx, no failed connection, no reply that ended with an error other than the student leaving;
  - no leak: KV blocks in use and live requests back to 0; the server's resident memory at the end, once
    the engine has emptied (and so handed its heap's free memory back), within --rss-tolerance (5 %) of
    what it was after the first --warmup-minutes (the server claims its KV cache at start, so the cache is
    counted from the first minute: docs/reliability.md);
  - time between tokens steady: p99 of the gaps between a reply's streamed chunks (the room's chat
    sends a chunk per decoded piece of text, usually one token), while no lesson is in force, in the
    first --window minutes and in the last, the last at most --tbt-tolerance (1.25x) the first.
    Gaps while a lesson is in force are reported apart: lesson 2 stalls replies on purpose.
Percentiles are app.readers.metrics.percentile. The CPU is named in the report.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.readers.metrics import percentile
from app.serving.engine_loop import HEAP_IDLE_S
from demos.load.room import ARGS, CHROMIUM, QUESTIONS, cpu_line
from demos.load.soak import free_port, rss_mb, wait_healthy

RESTORED = ("policy", "max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk", "enable_prefix_caching",
            "max_kv_blocks", "step_delay", "speculative_config")
LESSONS = 8


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and every descendant (the pair's fork server and workers)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += rss_mb(p)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


class Lecture:
    """What every student and the lecturer record: one clock, one place."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.in_lesson = False
        self.gaps: list[tuple[float, float, bool]] = []   # (seconds since start, gap s, lesson in force)
        self.ttft: list[tuple[float, float]] = []
        self.status: dict[str, int] = {}
        self.errors: list[str] = []
        self.reply_errors: list[str] = []
        self.joins = self.leaves = self.left_mid_reply = self.replies = self.lessons = 0
        self.samples: list[dict] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def count(self, status: int):
        key = "5xx" if status >= 500 else str(status)
        self.status[key] = self.status.get(key, 0) + 1


async def chat(http, token: str, text: str, lec: Lecture, leave_after: int | None) -> str:
    """One message and its streamed reply. leave_after: leave the room after that many chunks."""
    t0, last, chunks = time.monotonic(), None, 0
    async with http.stream("POST", "/api/room/chat", json={"text": text}, headers={"X-Room-Token": token}) as r:
        lec.count(r.status_code)
        if r.status_code != 200:
            await r.aread()
            if r.status_code >= 500 and len(lec.errors) < 5:
                lec.errors.append(f"chat {r.status_code}: {r.text[:160]}")
            return "refused"
        async for line in r.aiter_lines():
            if not line:
                continue
            msg, t = json.loads(line), time.monotonic()
            if "text" in msg:
                if last is None:
                    lec.ttft.append((lec.now(), t - t0))
                else:
                    lec.gaps.append((lec.now(), t - last, lec.in_lesson))
                last, chunks = t, chunks + 1
                if leave_after is not None and chunks >= leave_after:
                    left = await http.post("/api/room/leave", headers={"X-Room-Token": token})
                    lec.count(left.status_code)
                    lec.left_mid_reply += 1
                    leave_after = None           # read on: the reply must end (aborted) by itself
                    continue
            elif "error" in msg:
                if "left the room" not in msg["error"] and len(lec.reply_errors) < 5:
                    lec.reply_errors.append(msg["error"][:160])
                return "left" if "left the room" in msg["error"] else "error"
            elif "done" in msg:
                lec.replies += 1
                return "done"
    return "cut"


async def student(base: str, i: int, stop: asyncio.Event, lec: Lecture, rng: random.Random):
    async with httpx.AsyncClient(base_url=base, timeout=600, trust_env=False) as http:
        await asyncio.sleep(rng.uniform(0, 20))           # the room fills over the first seconds
        visit = 0
        while not stop.is_set():
            visit += 1
            try:
                r = await http.post("/api/room/join", json={"name": f"Student {i + 1}"})
                lec.count(r.status_code)
                if r.status_code != 200:
                    await asyncio.sleep(5)
                    continue
                token, lec.joins = r.json()["token"], lec.joins + 1
                left = False
                for _ in range(rng.randint(2, 6)):
                    if stop.is_set():
                        break
                    leave_after = rng.randint(1, 8) if rng.random() < 0.08 else None
                    outcome = await chat(http, token, rng.choice(QUESTIONS), lec, leave_after)
                    if leave_after is not None and outcome != "refused":
                        left = True
                        break
                    await asyncio.sleep(rng.uniform(3, 12))          # reading the reply, typing the next
                if not left:
                    r = await http.post("/api/room/leave", headers={"X-Room-Token": token})
                    lec.count(r.status_code)
                lec.leaves += 1
                await asyncio.sleep(rng.uniform(5, 40))              # out of the room for a while
            except httpx.HTTPError as e:
                if len(lec.errors) < 5:
                    lec.errors.append(f"{type(e).__name__}: {e}"[:200])
                lec.status["connection"] = lec.status.get("connection", 0) + 1
                await asyncio.sleep(2)


async def lecturer(base: str, http, settings: dict, stop: asyncio.Event, lec: Lecture, every: float,
                   lasts: float, settle: float, browser):
    """The lecturer's page: press the next lesson every `every` seconds; `lasts` seconds later, the
    room's settings back. A lesson is in force from its press until `settle` seconds after that."""
    page = await (await browser.new_context(viewport={"width": 1600, "height": 1000})).new_page()
    await page.goto(base + "/")
    await page.wait_for_selector("#bs-lesson-1", timeout=120_000)
    restore = {k: settings[k] for k in RESTORED if k in settings}
    k = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every - lasts - settle)
            break
        except asyncio.TimeoutError:
            pass
        lec.in_lesson, k = True, k % LESSONS + 1
        await page.click(f"#bs-lesson-{k}")
        lec.lessons += 1
        try:
            await asyncio.wait_for(stop.wait(), lasts)
        except asyncio.TimeoutError:
            pass
        r = await http.post("/api/engine", json=restore)
        lec.count(r.status_code)
        if r.status_code != 200 and len(lec.errors) < 5:
            lec.errors.append(f"restoring the settings: {r.status_code} {r.text[:160]}")
        try:                                      # its scripted replies still end under the room's settings
            await asyncio.wait_for(stop.wait(), settle)
        except asyncio.TimeoutError:
            pass
        lec.in_lesson = False


async def sampler(http, pid: int, stop: asyncio.Event, lec: Lecture):
    while not stop.is_set():
        try:
            state = (await http.get("/api/engine")).json()
            lec.samples.append({"t": lec.now(), "rss": rss_mb(pid), "tree": tree_rss_mb(pid),
                                "kv": state["kv"]["used"], "live": state["live_requests"],
                                "waiting": state["waiting"], "running": state["running"]})
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        await asyncio.sleep(1)


async def run(args) -> dict:
    from playwright.async_api import async_playwright
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60, trust_env=False) as http:
            await wait_healthy(http)
            settings = (await http.get("/api/engine")).json()
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                projector = await (await browser.new_context(viewport={"width": 1920, "height": 1080})).new_page()
                await projector.goto(base + "/?view=projector")
                stop, lec = asyncio.Event(), Lecture(time.monotonic())
                rng = random.Random(args.seed)
                tasks = [asyncio.ensure_future(student(base, i, stop, lec, random.Random(rng.random())))
                         for i in range(args.students)]
                tasks.append(asyncio.ensure_future(lecturer(base, http, settings, stop, lec, args.lesson_every,
                                                            args.lesson_seconds, args.settle, browser)))
                watch = asyncio.ensure_future(sampler(http, server.pid, stop, lec))
                await asyncio.sleep(args.minutes * 60)
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                watch.cancel()
                state = {}
                for _ in range(120):                 # every request has ended or been aborted
                    state = (await http.get("/api/engine")).json()
                    if state["live_requests"] == 0 and state["kv"]["used"] == 0:
                        break
                    await asyncio.sleep(0.5)
                await asyncio.sleep(HEAP_IDLE_S + 1)   # the engine's lull: its heap's free memory goes back
                rss_end, tree_end = rss_mb(server.pid), tree_rss_mb(server.pid)
                healthy = (await http.get("/healthz")).status_code == 200
                await browser.close()
        return figures(args, lec, settings, state, rss_end, tree_end, healthy, [t for t in tasks if t.done()])
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def figures(args, lec: Lecture, settings: dict, state: dict, rss_end: float, tree_end: float, healthy: bool,
            tasks) -> dict:
    crashed = [repr(t.exception())[:200] for t in tasks if t.exception() is not None]
    warm = [s for s in lec.samples if s["t"] >= args.warmup_minutes * 60]
    window, end = args.window * 60, args.minutes * 60

    def p99(lo: float, hi: float, lesson: bool) -> tuple[float | None, int]:
        gaps = [g for t, g, in_lesson in lec.gaps if lo <= t < hi and in_lesson == lesson]
        return percentile(gaps, 99), len(gaps)

    windows = []
    for lo in range(0, int(end), int(window)):
        room, n_room = p99(lo, lo + window, False)
        lesson, n_lesson = p99(lo, lo + window, True)
        ttft = [d for t, d in lec.ttft if lo <= t < lo + window]
        rss = [x["rss"] for x in lec.samples if lo <= x["t"] < lo + window]
        windows.append({"minutes": f"{lo / 60:.0f}-{min(lo + window, end) / 60:.0f}", "tbt_p99_room": room,
                        "gaps_room": n_room, "tbt_p99_lesson": lesson, "gaps_lesson": n_lesson,
                        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "replies_begun": len(ttft),
                        "rss_end_mb": rss[-1] if rss else None})
    return {
        "cpu": cpu_line(), "minutes": args.minutes, "students": args.students, "lessons_pressed": lec.lessons,
        "settings": {k: settings.get(k) for k in ("policy", "max_num_seqs", "max_num_batched_tokens", "dtype")},
        "joins": lec.joins, "leaves": lec.leaves, "left_mid_reply": lec.left_mid_reply, "replies": lec.replies,
        "status": lec.status, "errors": lec.errors, "reply_errors": lec.reply_errors, "crashed_tasks": crashed,
        "kv_used_after": state.get("kv", {}).get("used"), "live_after": state.get("live_requests"),
        "preemptions": state.get("preemptions"), "aborted": state.get("requests_aborted"),
        "kv_used_peak": max((s["kv"] for s in lec.samples), default=None),
        "waiting_peak": max((s["waiting"] for s in lec.samples), default=None),
        "rss_warm_mb": warm[0]["rss"] if warm else None, "rss_end_mb": rss_end,
        "rss_peak_mb": max((s["rss"] for s in lec.samples), default=None),
        "tree_warm_mb": warm[0]["tree"] if warm else None, "tree_end_mb": tree_end,
        "tree_peak_mb": max((s["tree"] for s in lec.samples), default=None),
        "healthy_after": healthy, "windows": windows,
    }


def verdict(r: dict, args) -> list[str]:
    problems = []
    if r["status"].get("5xx"):
        problems.append(f"{r['status']['5xx']} responses were 5xx")
    if r["status"].get("connection") or r["errors"] or r["crashed_tasks"]:
        problems.append(f"errors: {(r['errors'] + r['crashed_tasks'])[:3]}")
    if r["reply_errors"]:
        problems.append(f"replies ended with an error: {r['reply_errors'][:3]}")
    if r["kv_used_after"] or r["live_after"]:
        problems.append(f"{r['kv_used_after']} KV blocks / {r['live_after']} requests left")
    if not r["healthy_after"]:
        problems.append("server unhealthy afterwards")
    if r["rss_warm_mb"] is None:
        problems.append("the server's RSS after the warm-up was not read")
    elif r["rss_end_mb"] > r["rss_warm_mb"] * (1 + args.rss_tolerance):
        problems.append(f"server RSS grew from {r['rss_warm_mb']:.0f} to {r['rss_end_mb']:.0f} MB "
                        f"({r['rss_end_mb'] / r['rss_warm_mb'] - 1:+.1%}, bound {args.rss_tolerance:.0%})")
    first, last = r["windows"][0]["tbt_p99_room"], r["windows"][-1]["tbt_p99_room"]
    if first is None or last is None or last > first * args.tbt_tolerance:
        problems.append(f"p99 time between tokens went from {first} s (first window) to {last} s (last)")
    if not r["lessons_pressed"]:
        problems.append("no lesson was pressed")
    return problems


def report(r: dict) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f} ms"
    s = lambda v: "-" if v is None else f"{v:.2f} s"
    lines = [f"CPU: {r['cpu']}",
             f"{r['students']} students for {r['minutes']} min on the server's defaults ({r['settings']}); "
             f"{r['lessons_pressed']} lessons pressed",
             f"joins {r['joins']}, leaves {r['leaves']} ({r['left_mid_reply']} in the middle of a reply), "
             f"replies {r['replies']}, HTTP statuses {r['status']}",
             f"after: KV blocks in use {r['kv_used_after']}, live requests {r['live_after']}, healthy "
             f"{r['healthy_after']}; peak KV blocks {r['kv_used_peak']}, peak waiting {r['waiting_peak']}, "
             f"preemptions {r['preemptions']}, aborted {r['aborted']}",
             f"server RSS: {r['rss_warm_mb']:.0f} MB after warm-up, {r['rss_end_mb']:.0f} MB at the end, "
             f"peak {r['rss_peak_mb']:.0f}; with its children {r['tree_warm_mb']:.0f} / {r['tree_end_mb']:.0f} / "
             f"{r['tree_peak_mb']:.0f} MB",
             "", f"{'minutes':<9}{'TBT p99 room':>14}{'(gaps)':>8}{'TBT p99 lesson':>16}{'(gaps)':>8}"
             f"{'TTFT p50':>10}{'TTFT p99':>10}{'replies':>9}{'RSS MB':>8}"]
    for w in r["windows"]:
        lines.append(f"{w['minutes']:<9}{ms(w['tbt_p99_room']):>14}{w['gaps_room']:>8}{ms(w['tbt_p99_lesson']):>16}"
                     f"{w['gaps_lesson']:>8}{s(w['ttft_p50']):>10}{s(w['ttft_p99']):>10}{w['replies_begun']:>9}"
                     f"{w['rss_end_mb'] or 0:>8.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m demos.load.classroom", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--students", type=int, default=60)
    p.add_argument("--lesson-every", type=float, default=180, help="seconds between lesson presses")
    p.add_argument("--lesson-seconds", type=float, default=60, help="seconds a lesson's settings stay in force")
    p.add_argument("--settle", type=float, default=30, help="seconds after the settings are back that the "
                   "lesson still counts as in force (its last scripted replies)")
    p.add_argument("--window", type=float, default=5, help="minutes per row of the report")
    p.add_argument("--warmup-minutes", type=float, default=5, help="the RSS baseline is read after this")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--tbt-tolerance", type=float, default=1.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.lesson_seconds + args.settle >= args.lesson_every:
        p.error("--lesson-seconds plus --settle must be shorter than --lesson-every")
    if args.window > args.minutes or args.warmup_minutes >= args.minutes:
        p.error("--window and --warmup-minutes must be shorter than --minutes")
    r = asyncio.run(run(args))
    r["problems"] = verdict(r, args)
    print(report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    print("PASS" if not r["problems"] else "FAIL: " + "; ".join(r["problems"]))
    return 0 if not r["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
