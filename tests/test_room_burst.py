"""The room at its peak, in a size CI can afford: `python -m app` on its own defaults, on the real default
model, and a burst of students sending at once through the official openai client from 127.0.0.1 with no
identity, as a room simulated on one machine does. Every one of them must be answered: no 429 (the
address's bucket of 30 turned away the rest of a burst of 60 before loopback callers were let through),
no 5xx. The full measurement with TTFT is `python -m demos.load.room --burst` (docs/server.md)."""
import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from app.config import ServerConfig
from tests.helpers import Served

pytestmark = [pytest.mark.server, pytest.mark.model]

ROOT = Path(__file__).resolve().parent.parent
STUDENTS = 40                # more than one address's burst (30): one bucket for them all would refuse ten
QUESTIONS = ["Name a colour.", "What is two plus two?", "Say hello.", "Name a fruit."]


async def burst(url: str, model: str, students: int, max_tokens: int) -> list[tuple[object, int]]:
    """(status, content chunks) of each student's streamed reply, all sent at the same moment."""
    from openai import APIStatusError, AsyncOpenAI
    pool = httpx.AsyncClient(trust_env=False, timeout=300, limits=httpx.Limits(max_connections=students + 2))
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=pool)
    go = asyncio.Event()

    async def student(i: int):
        await go.wait()
        try:
            stream = await client.chat.completions.create(
                model=model, stream=True, max_tokens=max_tokens, user=f"Student {i}",
                messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            chunks = 0
            async for chunk in stream:
                chunks += bool(chunk.choices and chunk.choices[0].delta.content)
            return 200, chunks
        except APIStatusError as e:
            return e.status_code, 0
    tasks = [asyncio.ensure_future(student(i)) for i in range(students)]
    await asyncio.sleep(0.1)
    go.set()
    try:
        return await asyncio.gather(*tasks)
    finally:
        await client.close()


@pytest.mark.timeout(600)
def test_a_burst_of_students_on_loopback_is_served_on_the_defaults():
    assert STUDENTS > ServerConfig().rate_limit_burst        # the case that used to be refused
    server = Served([sys.executable, "-m", "app", "--port", "0", "--log-level", "warning"], cwd=ROOT, env=None)
    try:
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            results = asyncio.run(burst(server.url, model, STUDENTS, max_tokens=8))
            statuses = sorted(str(s) for s, _ in results)
            assert statuses == ["200"] * STUDENTS, f"not every student was answered: {statuses}"
            assert all(chunks > 0 for _, chunks in results), "a reply came back empty"
            state = http.get("/api/engine").json()
            assert state["live_requests"] == 0 and state["requests_finished"] >= STUDENTS
            assert state["max_num_seqs"] >= STUDENTS, "the defaults do not hold the whole burst in one batch"
    finally:
        server.stop()


def test_the_room_demos_frame_rate_counts_drawn_frames_not_a_resting_stages_looks():
    """static/main.js counts a resting stage's looks (ten a second) among its frames and apart in
    `idleTicks`: the demo's fps is the frames the stage was awake for, and the looks are their own column."""
    from demos.load.room import fps_row
    a = dict(now=0, frames=100, draws=10, drawMs=5.0, maxDrawMs=2.0, slowFrames=1, idleTicks=40)
    b = dict(now=10_000, frames=700, draws=30, drawMs=15.0, maxDrawMs=3.0, slowFrames=7, idleTicks=90)
    row = fps_row("tab", a, b)
    assert row["fps"] == (600 - 50) / 10 and row["resting_looks_per_s"] == 50 / 10
    assert row["slow_share"] == 6 / 550 and row["redraws_per_s"] == 2.0 and row["draw_ms_mean"] == 0.5
