"""A room of simulated students against a real server: does the chart keep up, and how long do they wait?

    python -m demos.load.room                          # 60 students (3 of them real browser tabs) for 60 s
    python -m demos.load.room --students 30 --tabs 2 --seconds 30 --screenshots docs/
    python -m demos.load.room --burst                  # the room at its peak: 60 send at once, on the defaults

It starts `python -m app` on a free 127.0.0.1 port, then:
  - students minus tabs API clients (the official openai client, `user` = their name, each from its own
    X-Forwarded-For address as on a lecture-hall network) chat in a loop with a few seconds of thinking;
  - `tabs` Chromium tabs open /join, join under a name and send a message every few seconds;
  - one Chromium tab shows the projector view /?view=projector.
It reports, side by side: the browsers' frame rate (frames per second while the stage is awake, share of
frames slower than 30 fps, a resting stage's looks per second, chart redraw time), the server's step rate
and output tokens per second, and time to first token measured by the clients (p50/p90/p99, percentile as
in app/readers/metrics.py). Not a test: a measurement, printed with the CPU it ran on.

--burst is the room at its peak: the server on its own defaults (no engine flag unless given), the
projector page open in Chromium, and every student sending one chat at the same moment through the
official openai client, all from 127.0.0.1 without an identity (as a room simulated on one machine is).
It reports how many were answered, refused (429) or failed, and TTFT p50/p99/max over all of them.
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
from demos.load.soak import free_port, wait_healthy

QUESTIONS = ["What is a GPU, in two sentences?", "Write a haiku about rain.", "Name three prime numbers.",
             "Why is the sky blue?", "Give one tip for learning to cook.", "How do bees find their hive?",
             "What is the capital of France?", "Explain what a recipe is to a child."]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
CHROMIUM = "/usr/bin/chromium"


def cpu_line() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    marks = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} logical CPUs, flags: {' '.join(marks) or 'none of avx2/avx512/amx'}"


def start_server(port: int, args) -> subprocess.Popen:
    """`python -m app` on the server's defaults, but for the flags given here."""
    cmd = [sys.executable, "-m", "app", "--port", str(port), "--log-level", "warning"]
    for flag in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_viewers", "kv_cache_gb", "cpu_threads"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def served_model(http, server) -> str:
    """Wait until the server answers; the model it serves. A server that did not start is stopped, its log said."""
    try:
        await wait_healthy(http)
    except RuntimeError:
        server.terminate()
        raise RuntimeError("the server did not start: " + server.stderr.read()[-800:]) from None
    return (await http.get("/v1/models")).json()["data"][0]["id"]


async def api_student(base: str, model: str, i: int, stop: asyncio.Event, stats: dict, max_tokens: int,
                      rng: random.Random):
    """One student on the OpenAI API: ask, read the whole reply, think, ask again."""
    from openai import APIStatusError, AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600,
                         default_headers={"X-Forwarded-For": f"10.20.{i // 250}.{i % 250 + 1}"})
    await asyncio.sleep(rng.uniform(0, 5))                # students do not all press Enter at once
    try:
        while not stop.is_set():
            t0, first, tokens = time.monotonic(), None, 0
            try:
                stream = await client.chat.completions.create(
                    model=model, stream=True, max_tokens=max_tokens, user=f"Student {i + 1}",
                    messages=[{"role": "user", "content": rng.choice(QUESTIONS)}])
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        tokens += 1
                        first = first or time.monotonic()
                stats["ttft"].append(first - t0) if first else None
                stats["done"] += 1
                stats["tokens"] += tokens
            except APIStatusError as e:
                stats["refused" if e.status_code == 429 else "errors"] += 1
                if e.status_code != 429 and len(stats["messages"]) < 3:
                    stats["messages"].append(str(e)[:200])
            await asyncio.sleep(rng.uniform(2, 8))
    finally:
        await client.close()


async def tab_student(page, name: str, stop: asyncio.Event, rng: random.Random):
    """A real browser tab on /join: join under a name, then send a message every few seconds."""
    await page.wait_for_function("document.querySelector('[data-testid=student-name]').value !== ''")
    await page.fill("[data-testid=student-name]", name)
    await page.click("[data-testid=join]")
    await page.wait_for_selector("[data-testid=you-are]:not([hidden])")
    while not stop.is_set():
        await page.fill("[data-testid=student-box]", rng.choice(QUESTIONS))
        await page.click("[data-testid=student-send]")
        await asyncio.sleep(rng.uniform(4, 9))


PERF = "({...BS.perf, now: performance.now()})"


async def peak_waiting(http, stop: asyncio.Event) -> int:
    """The longest waiting queue seen, sampled once a second."""
    peak = 0
    while not stop.is_set():
        peak = max(peak, (await http.get("/api/engine")).json()["waiting"])
        await asyncio.sleep(1)
    return peak


def fps_row(name: str, a: dict, b: dict) -> dict:
    """One tab's counters (static/main.js `perf`) at the start (a) and the end (b) of the measurement. A stage
    with nothing moving rests and looks ten times a second (`idleTicks`, counted among its frames too): fps is
    the frames it was awake for, and the looks have a column of their own."""
    sec = (b["now"] - a["now"]) / 1000
    looks = b["idleTicks"] - a["idleTicks"]
    frames, draws = b["frames"] - a["frames"] - looks, b["draws"] - a["draws"]
    return {"tab": name, "fps": frames / sec, "slow_share": (b["slowFrames"] - a["slowFrames"]) / max(1, frames),
            "resting_looks_per_s": looks / sec, "redraws_per_s": draws / sec,
            "draw_ms_mean": (b["drawMs"] - a["drawMs"]) / max(1, draws), "draw_ms_max_run": b["maxDrawMs"]}


async def run(args) -> dict:
    from playwright.async_api import async_playwright
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(port, args)
    rng = random.Random(args.seed)
    stats = {"ttft": [], "done": 0, "refused": 0, "errors": 0, "tokens": 0, "messages": []}
    stop = asyncio.Event()
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            model = await served_model(http, server)
            max_num_seqs = (await http.get("/api/engine")).json()["max_num_seqs"]
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                projector = await (await browser.new_context(viewport={"width": 1920, "height": 1080})).new_page()
                await projector.goto(base + "/?view=projector")
                tabs = []
                for k in range(args.tabs):
                    pg = await (await browser.new_context(viewport={"width": 1280, "height": 1000})).new_page()
                    await pg.goto(base + "/?role=student")
                    tabs.append(pg)
                names = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay"]
                tasks = [asyncio.ensure_future(tab_student(pg, names[k % len(names)], stop, rng))
                         for k, pg in enumerate(tabs)]
                tasks += [asyncio.ensure_future(api_student(base, model, i, stop, stats, args.max_tokens, rng))
                          for i in range(args.students - args.tabs)]
                await asyncio.sleep(args.warmup)
                pages = [("projector", projector)] + [(f"student tab {k + 1}", pg) for k, pg in enumerate(tabs)]
                before = [await pg.evaluate(PERF) for _, pg in pages]
                step0, t0, tok0, ttft0 = ((await http.get("/api/engine")).json()["step"], time.monotonic(),
                                          stats["tokens"], len(stats["ttft"]))
                peak = asyncio.ensure_future(peak_waiting(http, stop))
                await asyncio.sleep(args.seconds)
                step1, t1 = (await http.get("/api/engine")).json()["step"], time.monotonic()
                after = [await pg.evaluate(PERF) for _, pg in pages]
                rows = [await pg.evaluate("document.querySelectorAll('[data-testid=row-labels] li').length")
                        for _, pg in pages]
                if args.screenshots:
                    out = Path(args.screenshots)
                    out.mkdir(parents=True, exist_ok=True)
                    await projector.screenshot(path=str(out / "ui_projector.png"))
                    if tabs:
                        await tabs[0].screenshot(path=str(out / "ui_student.png"), full_page=True)
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                waiting_peak = await peak
                await browser.close()
        ttft = stats["ttft"][ttft0:]
        return {
            "cpu": cpu_line(), "students": args.students, "tabs": args.tabs, "seconds": round(t1 - t0, 1),
            "max_num_seqs": max_num_seqs, "max_tokens": args.max_tokens,
            "steps_per_s": (step1 - step0) / (t1 - t0), "api_tokens_per_s": (stats["tokens"] - tok0) / (t1 - t0),
            "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
            "ttft_n": len(ttft), "waiting_peak": waiting_peak, "replies": stats["done"],
            "refused_429": stats["refused"], "errors": stats["errors"],
            "error_messages": stats["messages"],
            "browsers": [fps_row(name, a, b) | {"rows_on_screen": n}
                         for (name, _), a, b, n in zip(pages, before, after, rows)],
        }
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


async def burst_student(client, model: str, i: int, go: asyncio.Event, max_tokens: int) -> dict:
    """One student of the burst: wait for the moment everyone presses Enter, ask once, read the reply."""
    from openai import APIStatusError
    await go.wait()
    t0, first, tokens = time.monotonic(), None, 0
    try:
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, user=f"Student {i + 1}",
            messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                tokens += 1
                first = first or time.monotonic()
        return {"status": 200, "ttft": None if first is None else first - t0, "tokens": tokens,
                "seconds": time.monotonic() - t0}
    except APIStatusError as e:
        return {"status": e.status_code, "message": str(e)[:200]}
    except Exception as e:                              # a dropped connection is a failure too
        return {"status": "error", "message": f"{type(e).__name__}: {e}"[:200]}


async def run_burst(args) -> dict:
    """The room at its peak (--burst): every student sends at once, the projector page open."""
    from openai import AsyncOpenAI
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(port, args)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60, trust_env=False) as http:
            model = await served_model(http, server)
            settings = (await http.get("/api/engine")).json()
            # one HTTP client for the room, with a connection for each student: all on 127.0.0.1
            pool = httpx.AsyncClient(trust_env=False, timeout=600,
                                     limits=httpx.Limits(max_connections=args.students + 4))
            client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, http_client=pool)
            browser = playwright = None
            if args.page:
                from playwright.async_api import async_playwright
                playwright = await async_playwright().start()
                browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                page = await (await browser.new_context(viewport={"width": 1920, "height": 1080})).new_page()
                await page.goto(base + "/?view=projector")
                await page.wait_for_selector("canvas")
            try:
                go = asyncio.Event()
                tasks = [asyncio.ensure_future(burst_student(client, model, i, go, args.max_tokens))
                         for i in range(args.students)]
                await asyncio.sleep(0.2)
                step0, t0 = (await http.get("/api/engine")).json()["step"], time.monotonic()
                go.set()
                results = await asyncio.gather(*tasks)
                seconds = time.monotonic() - t0
                step1 = (await http.get("/api/engine")).json()["step"]
            finally:
                await client.close()
                if browser:
                    await browser.close()
                    await playwright.stop()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    ttft = [r["ttft"] for r in results if r.get("ttft") is not None]
    return {"cpu": cpu_line(), "students": args.students, "max_tokens": args.max_tokens, "page_open": args.page,
            "max_num_seqs": settings["max_num_seqs"], "max_num_batched_tokens": settings["max_num_batched_tokens"],
            "answered": sum(r["status"] == 200 for r in results),
            "refused_429": sum(r["status"] == 429 for r in results),
            "failed": sum(r["status"] not in (200, 429) for r in results),
            "messages": sorted({r["message"] for r in results if "message" in r})[:3],
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "ttft_max": max(ttft, default=None),
            "seconds": round(seconds, 1), "steps": step1 - step0,
            "output_tokens_per_s": sum(r.get("tokens", 0) for r in results) / seconds}


def burst_report(r: dict) -> str:
    s = lambda v: "–" if v is None else f"{v:.2f} s"
    return "\n".join([
        f"CPU: {r['cpu']}",
        f"{r['students']} students at once, replies of up to {r['max_tokens']} tokens, projector page "
        f"{'open' if r['page_open'] else 'closed'}; server: {r['max_num_seqs']} sequences, budget "
        f"{r['max_num_batched_tokens']}",
        f"answered {r['answered']}, refused (429) {r['refused_429']}, failed {r['failed']}",
        *[f"  {m}" for m in r["messages"]],
        f"time to first token: p50 {s(r['ttft_p50'])}, p99 {s(r['ttft_p99'])}, max {s(r['ttft_max'])}; "
        f"all done in {r['seconds']} s, {r['steps']} steps, {r['output_tokens_per_s']:.1f} output tokens/s"])


def report(r: dict) -> str:
    s = lambda v: "–" if v is None else f"{v:.2f} s"
    lines = [f"CPU: {r['cpu']}",
             f"{r['students']} students ({r['tabs']} browser tabs, {r['students'] - r['tabs']} API clients), "
             f"max_num_seqs {r['max_num_seqs']}, replies of up to {r['max_tokens']} tokens, measured {r['seconds']} s",
             f"server: {r['steps_per_s']:.1f} steps/s, {r['api_tokens_per_s']:.1f} output tokens/s to the API clients, "
             f"waiting queue peak {r['waiting_peak']}",
             f"time to first token (API clients, n={r['ttft_n']}): p50 {s(r['ttft_p50'])}, p90 {s(r['ttft_p90'])}, "
             f"p99 {s(r['ttft_p99'])}; replies {r['replies']}, refused (429) {r['refused_429']}, errors {r['errors']}",
             *[f"  error: {m}" for m in r["error_messages"]],
             "", f"{'browser':<16}{'fps':>7}{'<30fps':>9}{'rest looks/s':>14}{'redraws/s':>11}{'draw ms':>9}"
                 f"{'max ms':>8}{'rows':>6}"]
    for b in r["browsers"]:
        lines.append(f"{b['tab']:<16}{b['fps']:>7.1f}{b['slow_share'] * 100:>8.1f}%{b['resting_looks_per_s']:>14.1f}"
                     f"{b['redraws_per_s']:>11.1f}{b['draw_ms_mean']:>9.1f}{b['draw_ms_max_run']:>8.1f}"
                     f"{b['rows_on_screen']:>6}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m demos.load.room", description=__doc__.split("\n")[0])
    p.add_argument("--students", type=int, default=60)
    p.add_argument("--tabs", type=int, default=3, help="of the students, how many are real browser tabs")
    p.add_argument("--seconds", type=float, default=60, help="measured time, after the warm-up")
    p.add_argument("--warmup", type=float, default=15)
    p.add_argument("--burst", action="store_true", help="every student sends one chat at once (the room at its peak)")
    p.add_argument("--no-page", dest="page", action="store_false", help="--burst: no projector page in Chromium")
    p.add_argument("--max-tokens", type=int, default=None, help="reply length (default 32; --burst: 64)")
    # the server's own defaults unless given
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=None)
    p.add_argument("--max-viewers", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--screenshots", help="folder for ui_student.png and ui_projector.png")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    if not 0 <= args.tabs <= args.students:
        p.error("--tabs must be between 0 and --students")
    if args.max_tokens is None:
        args.max_tokens = 64 if args.burst else 32
    if args.students < 1 or args.max_tokens < 1:
        p.error("--students and --max-tokens must be at least 1")
    result = asyncio.run(run_burst(args) if args.burst else run(args))
    print(burst_report(result) if args.burst else report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
