"""The live service moving between the single engine and the disaggregated pair (engine/engines.py):
the pair starts on first selection while requests keep being served, new requests go to the setting
in force, requests in flight finish where they started, and viewers get one step numbering."""
import asyncio
import time

import httpx
import pytest

from app import EngineService, ServerConfig, create_app
from engine import EngineConfig, SamplingParams

pytestmark = pytest.mark.model
ASK = [{"role": "user", "content": "Write a haiku about the sea."}]


async def reply(service, label: str, max_tokens: int = 24):
    stream = await service.submit(messages=ASK, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  label=label)
    return stream, asyncio.ensure_future(stream.text())


async def until(check, timeout: float = 400.0):
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


async def switch_and_back(service):
    loop = service.engine          # the switch between the single engine and the pair (engine/engines.py)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service, manage_service=False)),
                                 base_url="http://batchscope.test") as http:
        a, a_text = await reply(service, "A", 40)                        # single engine, chunked
        r = await http.post("/api/engine", json={"policy": "disaggregated", "max_num_batched_tokens": 32})
        assert r.status_code == 200, r.text
        assert r.json()["disaggregated"] == "starting" and r.json()["policy"] == "chunked"
        b, b_text = await reply(service, "B")                             # the pair is loading: single
        assert loop.owner[b.id] is loop.single
        async def ready():
            r = await http.get("/api/engine")
            if r.status_code == 503:                # a busy engine thread may answer late: ask again
                return False
            state = r.json()
            return state["disaggregated"] == "ready" and state["policy"] == "disaggregated"
        await until(ready)
        state = (await http.get("/api/engine")).json()
        assert state["max_num_batched_tokens"] == 32 and set(state["workers"]) == {"prefill", "decode"}
        c, c_text = await reply(service, "C", 40)                         # the pair
        assert loop.owner[c.id] is loop.pair
        await until(lambda: service.call(lambda: loop.get_request(c.id).num_output_tokens >= 2))
        r = await http.post("/api/engine", json={"policy": "chunked"})    # back, while C decodes on the pair
        assert r.status_code == 200 and r.json()["policy"] == "chunked"
        d, d_text = await reply(service, "D", 40)
        assert loop.owner[d.id] is loop.single and c.finish_reason is None
        texts = [await t for t in (a_text, b_text, c_text, d_text)]
    assert [s.finish_reason for s in (a, b, c, d)] == ["length"] * 4
    assert texts[2] == texts[3] == texts[0] and texts[1] == texts[0][:len(texts[1])]   # greedy: same words
    return a, b, c, d


def test_switching_to_disaggregated_and_back_loses_nothing_in_flight():
    service = EngineService(EngineConfig(dtype="float32", kv_cache_gb=0.1, max_model_len=1024),
                            ServerConfig(history=4096))
    service.start()
    try:
        a, b, c, d = asyncio.run(switch_and_back(service))
        _, records = service.ring.last_steps(4096)
    finally:
        service.stop()
    steps = [r for r in records if r["type"] == "step"]
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + len(steps)))
    by_req = lambda rid: {(s.get("worker"), i["kind"]) for s in steps for i in s["items"] if i["req"] == rid}
    assert by_req(c.id) == {("prefill", "prefill"), ("decode", "decode")}
    assert by_req(d.id) == by_req(a.id) == {(None, "prefill"), (None, "decode")}
    assert any(r.get("event") == "kv_transfer" and r["req"] == c.id for r in records)
    policies = [r["policy"] for r in records if r["type"] == "policy"]
    assert policies[-2:] == ["disaggregated", "chunked"]
    assert service.engine.pair.closed and not service.engine.owner
