"""A stand-in for vLLM for attach-mode tests: its OpenAI API (a small FastAPI app that streams like vLLM
and remembers what it was sent), its recorder (integrations/vllm's Publisher, sending records as the
recording scheduler does), the app attached to both (the `attached` fixture) and a step record maker."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from app.api.server import create_app
from app.config import ServerConfig
from app.serving.attach import AttachConfig, AttachedService
from integrations.vllm.publisher import Publisher

SETTINGS = {"policy": "chunked", "max_num_batched_tokens": 64, "max_num_seqs": 8, "max_prefill_chunk": None,
            "enable_chunked_prefill": True, "enable_prefix_caching": True, "async_scheduling": True, "block_size": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Thread(uvicorn.Server):
    def run_in_thread(self):
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        while not self.started:
            time.sleep(0.01)
        return t


def fake_vllm(sent: list[dict]) -> FastAPI:
    api = FastAPI()

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "SmolLM2-135M-Instruct", "max_model_len": 4096}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        sent.append(body)
        if len(body["messages"][0]["content"]) > 100:
            return StreamingResponse(iter([json.dumps({"error": {"message": "This model's maximum context length "
                                                                 "is 4096 tokens"}})]), status_code=400)

        async def events():
            for i, word in enumerate(["Hello", " there", "!"][:body["max_tokens"]]):
                chunk = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.01)
            done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            yield f"data: {json.dumps(done)}\n\n"
            usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                              "prompt_tokens_details": {"cached_tokens": 0}}}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return api


@pytest.fixture
def attached():
    sent: list[dict] = []
    vport = free_port()
    vllm = Thread(uvicorn.Config(fake_vllm(sent), host="127.0.0.1", port=vport, log_level="warning"))
    vllm.run_in_thread()
    pub = Publisher("127.0.0.1", 0, {"type": "hello", "engine": "vllm 0.32.0", "lane": 0, "lanes": 1,
                                     "device": "cpu/float32", "settings": SETTINGS, "time": time.time()})
    service = AttachedService(AttachConfig(f"http://127.0.0.1:{vport}", f"127.0.0.1:{pub.port}"), ServerConfig())
    service.start()
    aport = free_port()
    app_server = Thread(uvicorn.Config(create_app(service, manage_service=False), host="127.0.0.1", port=aport,
                                       log_level="warning"))
    app_server.run_in_thread()
    http = httpx.Client(base_url=f"http://127.0.0.1:{aport}", timeout=30, trust_env=False)
    yield http, pub, sent, service
    http.close()
    app_server.should_exit = vllm.should_exit = True
    service.stop()
    pub.close()


def step(n: int, t: float, items: list[dict]) -> dict:
    return {"type": "step", "step": n, "t_start": t, "t_end": t + 0.05, "policy": "chunked", "token_budget": 64,
            "max_num_seqs": 8, "items": items, "num_tokens": sum(i["tokens"] for i in items), "finished": [],
            "preempted": [], "stalled": [], "stall_causes": [], "failed": False, "waiting": 0, "running": len(items),
            "kv": {"used": 3, "total": 100, "cached": 0, "block_size": 16}}
