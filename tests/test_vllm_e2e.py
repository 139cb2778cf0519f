"""End to end over a real vLLM: `vllm serve` of the default model on the CPU with batchscope's recording
scheduler, this app attached to it, three streamed chats and a long document sent through the official
`openai` client, and the page in Chromium drawing vLLM's steps: the document's prefill split into chunks
beside the chats' decodes.

Marked `vllm`; runs wherever the vLLM environment exists (scripts/install_vllm.sh; CI makes it) and is
skipped, with that reason, where it does not. Kept short: vLLM starts with -O0 (no torch.compile: it
answers in under a minute instead of compiling for several), 1 GiB of KV cache, a 128-token budget, and
the fewest tokens that still show it: three replies of 32 tokens, and a ~500-token document that needs
four chunks, sent once the replies are decoding. About 45 s on a 2-core machine, more on a busy one (vLLM answers
after 30-40 s: its two processes import torch and vLLM).
    python3 -m pytest -s tests/test_vllm_e2e.py
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from demos.vllm import server as vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.server]
BUDGET = 128          # small, so the document's prefill needs several steps
REPLY = 32            # tokens per chat reply: enough steps for the document to arrive among them
DOCUMENT = " ".join(f"Paragraph {i}: the committee reviewed the budget, the schedule and the risks, and agreed "
                    f"to meet again next week." for i in range(20))


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    if vllm_server.vllm_python() is None:
        pytest.skip("no vLLM environment (.venv-vllm, or BATCHSCOPE_VLLM_PYTHON): bash scripts/install_vllm.sh "
                    "makes one")
    folder = vllm_server.folder_for()
    port, records = vllm_server.free_port(), vllm_server.free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    t0 = time.monotonic()
    # -O0: no torch.compile, so vLLM answers in about a minute instead of compiling for several (its compile
    # cache does not reload on this CPU build: every start compiles again). VLLM_ENABLE_V1_MULTIPROCESSING=0:
    # the model runs in the engine core's process, where the scheduler is, instead of a worker process of
    # its own (one process fewer importing torch and vLLM: 29 s to an answer instead of 35, 34 s of CPU
    # instead of 41)
    proc = vllm_server.start(folder, port, records, log, "--max-num-batched-tokens", str(BUDGET),
                             "--max-num-seqs", "8", "--optimization-level", "0", "--max-model-len", "2048",
                             kv_cache_gb=1, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        ready = vllm_server.wait_ready(proc, port, log)
        print(f"vLLM answered after {ready:.0f} s")
        yield f"http://127.0.0.1:{port}", f"127.0.0.1:{records}", ready
    finally:
        vllm_server.stop(proc)
        print(f"vLLM's whole run: {time.monotonic() - t0:.0f} s")


@pytest.fixture(scope="module")
def app_url(vllm):
    import uvicorn

    from app.__main__ import build, parse_args
    from demos.vllm.server import free_port
    url, records, _ = vllm
    port = free_port()
    service, app = build(parse_args(["--attach", url, "--attach-records", records, "--port", str(port)]), env={})
    service.start()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    service.stop()


def test_chats_and_a_document_through_the_app_show_vllms_chunks_beside_decodes(app_url):
    import httpx
    import openai

    async def chat(client, name: str, text: str, max_tokens: int, started: asyncio.Event | None = None) -> str:
        stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, user=name,
                                                      messages=[{"role": "user", "content": text}],
                                                      max_tokens=max_tokens, temperature=0,
                                                      extra_body={"ignore_eos": True})
        parts = []
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
                if started is not None:
                    started.set()
        return "".join(parts)

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{app_url}/v1", api_key="none",
                                    http_client=httpx.AsyncClient(trust_env=False, timeout=300))
        started = [asyncio.Event() for _ in range(3)]
        chats = [asyncio.ensure_future(chat(client, n, "Tell me a short story about a cat.", REPLY, ev))
                 for n, ev in zip(("Alice", "Bob", "Chen"), started)]
        for ev in started:                  # the replies are decoding when the document arrives
            await ev.wait()
        doc = await chat(client, "Doc", "Summarise this report in one sentence:\n" + DOCUMENT, 8)
        return await asyncio.gather(*chats), doc

    t = time.monotonic()
    replies, summary = asyncio.run(run())
    print(f"chats and document: {time.monotonic() - t:.1f} s")
    assert all(len(r) > 20 for r in replies) and summary, (replies, summary)
    assert len(set(replies)) == 1, "greedy replies to one prompt agree"
    records = httpx.get(f"{app_url}/api/trace", params={"last": 2000}, trust_env=False).json()["records"]
    steps = [r for r in records if r["type"] == "step"]
    assert len({r["step"] for r in steps}) == len(steps) and all(r.get("lane_step") is not None for r in steps)
    for r in steps:
        assert len({it["req"] for it in r["items"]}) == len(r["items"]) and r["num_tokens"] <= BUDGET
    by_label = lambda label, kind: [(r["step"], it) for r in steps for it in r["items"]
                                    if it["label"] == label and it["kind"] == kind]
    chunks = by_label("Doc", "prefill")
    assert len(chunks) >= 2 and all(it["tokens"] <= BUDGET for _, it in chunks), chunks
    assert [it["completes_prompt"] for _, it in chunks][-1] is True
    assert sum(it["tokens"] for _, it in chunks) + (chunks[0][1].get("cached") or 0) == chunks[0][1]["prompt_len"]
    chunk_steps = {s for s, _ in chunks}
    decodes_beside = {s for name in ("Alice", "Bob", "Chen") for s, _ in by_label(name, "decode")} & chunk_steps
    assert decodes_beside, "the chats kept decoding in the steps that carried the document's chunks"
    for name in ("Alice", "Bob", "Chen"):
        assert len(by_label(name, "decode")) >= REPLY - 2, f"{name}'s decodes are on the chart under its name"
    from app.readers import metrics
    summary_metrics = metrics.summarize(records)
    assert summary_metrics["output_tokens"] >= 3 * REPLY
    # the recorder's own share of vLLM's step loop: reading the step and assembling its record
    own = sum(r["timing"]["items"] + r["timing"]["record"] for r in steps)
    print(f"{len(steps)} steps; the recorder's share of their time: "
          f"{own / sum(r['t_end'] - r['t_start'] for r in steps):.4%}")
    from tests.browser import CHROMIUM, chromium, live_page
    if not CHROMIUM.exists():
        print("Chromium is not installed: the page was not checked")
        return
    with chromium() as browser, live_page(browser, app_url, {"width": 1400, "height": 1000}) as page:
        # the snapshot on connect carries the run: the chart holds the document's chunks beside decodes
        page.wait_for_function("() => BS.store.steps.some((s) => s.items.some((i) => i.label === 'Doc'))",
                               timeout=60000)
        mixed = page.evaluate("() => BS.store.steps.filter((s) => s.items.some((i) => i.label === 'Doc' && "
                              "i.kind === 'prefill') && s.items.some((i) => i.kind === 'decode')).length")
        assert mixed >= 1
        assert page.locator("[data-testid=gantt]").is_visible()
        assert page.locator("[data-testid=budget]").is_disabled(), "vLLM's budget is shown read-only"
