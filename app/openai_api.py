"""OpenAI-compatible routes: GET /v1/models and POST /v1/chat/completions (streaming or not).

Requests are checked strictly, as OpenAI's API does: wrong types, unknown
arguments and unsupported features get a 400 that names the parameter. The
official `openai` package and curl work unchanged (any API key is accepted).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from app.errors import APIError, from_validation, read_json
from app.rate_limit import client_of
from app.service import EngineService, QueueFull, ServiceUnavailable
from engine import SamplingParams

STRICT = ConfigDict(extra="forbid", strict=True)


# Unions are checked by hand (content, stop, tool_choice): pydantic would name the union member
# ("messages.0.content.str") instead of the parameter in its errors.

class Message(BaseModel):
    # clients echo back extra message fields (name, refusal, ...): ignore those
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: Any = None               # a string, or a list of {"type": "text", "text": ...} parts


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = STRICT
    messages: list[Message]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None          # vLLM extension
    ignore_eos: bool = False          # vLLM extension: fixed-length replies for benchmarks
    stop: Any = None                  # a string or a list of up to 4 strings
    seed: int | None = None
    n: int | None = None
    user: str | None = None           # shown as the request's label on the live chart
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None


def router(service: EngineService) -> APIRouter:
    api = APIRouter()
    cfg = service.config

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "batchscope", "max_model_len": service.max_model_len}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = ChatRequest.model_validate(await read_json(request, cfg.max_body_bytes))
        except ValidationError as e:
            raise from_validation(e) from None
        messages, params = _convert(body, service)
        label = (body.user or "").strip()[:32] or None
        try:
            client = client_of(request.headers, request.client.host if request.client else None)
            stream = await service.submit(messages=messages, params=params, label=label, client=client)
        except ValueError as e:
            code = "context_length_exceeded" if "limit is" in str(e) else None
            raise APIError(400, str(e), param="messages", code=code) from None
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except ServiceUnavailable as e:
            raise APIError(503, str(e), code="service_unavailable") from None
        meta = {"id": f"chatcmpl-{stream.id}", "created": int(time.time()), "model": service.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return AbortOnDisconnect(_sse(stream, meta, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(request, stream, meta)

    return api


def _convert(body: ChatRequest, service: EngineService) -> tuple[list[dict], SamplingParams]:
    """Check what the engine cannot express and build its inputs."""
    cfg = service.config
    if body.model is not None and body.model != service.model_name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{service.model_name}'.", param="model", code="model_not_found")
    unsupported = [(body.n not in (None, 1), "n", "only n=1 is supported"),
                   (bool(body.presence_penalty), "presence_penalty", "penalties are not supported"),
                   (bool(body.frequency_penalty), "frequency_penalty", "penalties are not supported"),
                   (bool(body.logprobs) or bool(body.top_logprobs), "logprobs", "logprobs are not supported"),
                   (bool(body.logit_bias), "logit_bias", "logit_bias is not supported"),
                   (bool(body.tools), "tools", "tools are not supported"),
                   (body.response_format not in (None, {"type": "text"}), "response_format",
                    "only response_format {'type': 'text'} is supported")]
    for bad, param, why in unsupported:
        if bad:
            raise APIError(400, why, param=param)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    elif max_tokens < 1:
        raise APIError(400, f"{param} must be at least 1, got {max_tokens}", param=param)
    elif max_tokens > cfg.max_tokens_cap:
        raise APIError(400, f"{param} is {max_tokens}; this server allows at most {cfg.max_tokens_cap}",
                       param=param)
    checks = [(body.temperature is not None and not 0 <= body.temperature <= 2, "temperature",
               "temperature must be between 0 and 2"),
              (body.top_p is not None and not 0 < body.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
              (body.top_k is not None and body.top_k < 0, "top_k", "top_k must be >= 0"),
              (body.seed is not None and not -2**63 <= body.seed < 2**64, "seed", "seed must fit in 64 bits")]
    stops = [body.stop] if isinstance(body.stop, str) else [] if body.stop is None else body.stop
    checks.append((not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(x, str) and x for x in stops),
                   "stop", "stop must be a string or a list of up to 4 non-empty strings"))
    for bad, param, why in checks:
        if bad:
            raise APIError(400, why, param=param)
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    if not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    params = SamplingParams(max_tokens=max_tokens, stop=stops, ignore_eos=body.ignore_eos,
                            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
                            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed)
    return messages, params


def _message(i: int, m: Message) -> dict:
    role = "system" if m.role == "developer" else m.role   # OpenAI's newer name for the system role
    if role not in ("system", "user", "assistant"):
        raise APIError(400, f"messages[{i}].role must be system, user or assistant, got {m.role!r}",
                       param=f"messages.{i}.role")
    content, param = m.content, f"messages.{i}.content"
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError(400, f"messages[{i}].content: only text parts are supported", param=param)
        content = "".join(p["text"] for p in content)
    if content is None:
        raise APIError(400, f"messages[{i}].content is missing", param=param)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts, "
                            f"got {type(content).__name__}", param=param)
    return {"role": role, "content": content}


async def _complete(request: Request, stream, meta: dict) -> JSONResponse:
    """Wait for the whole reply; a client that hangs up first aborts the request."""
    async with stream:
        reply = asyncio.ensure_future(stream.text())
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({reply, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not reply.done():
            reply.cancel()
            return JSONResponse({}, status_code=499)    # nobody is left to read it
        text = reply.result()
    if stream.finish_reason == "error" or (stream.finish_reason == "abort" and stream.error):
        status = 503 if "shutting down" in (stream.error or "") else 500
        raise APIError(status, stream.error or "the request failed")
    return JSONResponse({**meta, "object": "chat.completion",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": stream.finish_reason, "logprobs": None}],
                         "usage": _usage(stream)})


async def _sse(stream, meta: dict, include_usage: bool):
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        return event({**meta, "object": "chat.completion.chunk",
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]})

    async with stream:                      # closing early (client gone) aborts the request
        yield chunk({"role": "assistant", "content": ""})
        async for d in stream:
            if d.error:
                code = "service_unavailable" if "shutting down" in d.error else "server_error"
                yield event({"error": {"message": d.error, "type": "server_error", "param": None, "code": code}})
                break
            if d.text:
                yield chunk({"content": d.text})
            if d.finish_reason:
                yield chunk({}, d.finish_reason)
        if include_usage and not stream.error:
            yield event({**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage(stream)})
        yield "data: [DONE]\n\n"


def _usage(stream) -> dict:
    return {"prompt_tokens": stream.prompt_tokens, "completion_tokens": stream.completion_tokens,
            "total_tokens": stream.prompt_tokens + stream.completion_tokens}


async def _disconnected(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AbortOnDisconnect(StreamingResponse):
    """Streams and, the moment the client hangs up, closes the body generator (whose exit aborts the
    request), whatever ASGI spec version the server speaks."""

    async def __call__(self, scope, receive, send):
        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass
        body = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            body.cancel()
            gone.cancel()
            await asyncio.gather(body, gone, return_exceptions=True)
            await self.body_iterator.aclose()   # runs the generator's exit if it never started
        if body.done() and not body.cancelled() and body.exception() is not None:
            if not isinstance(body.exception(), OSError):
                raise body.exception()
