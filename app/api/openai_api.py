"""OpenAI-compatible routes: GET /v1/models, POST /v1/chat/completions and /v1/completions
(streaming or not; n choices, stop, seed, logprobs, usage with prefix-cache hits).

Requests are checked in app/api/openai_requests.py; here they become engine
requests, one per choice, and their replies become OpenAI's response and
stream shapes. The official `openai` package and curl work unchanged: any API
key is accepted unless the operator configured some (BATCHSCOPE_API_KEY), then
`Authorization: Bearer <key>` must carry one of them.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from app.api.errors import APIError, admission_error, failure_status, from_validation, read_json
from app.api.openai_requests import (
    ChatRequest,
    CompletionRequest,
    Sampling,
    chat_params,
    completion_params,
    message,
    prompt_input,
)
from app.serving.front import TokenLogprob
from app.serving.rate_limit import bearer, client_of
from app.serving.service import EngineService
from engine import SamplingParams


def router(service: EngineService) -> APIRouter:
    cfg = service.config

    async def api_key(request: Request):
        if cfg.api_keys and service.client_keys.api_key_number(bearer(request.headers)) is None:
            raise APIError(401, "this server needs an API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")
    api = APIRouter(dependencies=[Depends(api_key)])

    @api.get("/v1/models")
    async def models():
        # root and parent as vLLM gives them: clients read the tokenizer's name and the context length here
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "batchscope", "root": service.model_name, "parent": None,
                                            "max_model_len": service.max_model_len}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, ChatRequest, cfg.max_body_bytes)
        params = chat_params(body, service)
        messages = [message(i, m) for i, m in enumerate(body.messages)]
        if not messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        streams = await _submit(request, service, body, params, "messages", messages=messages)
        return await _respond(request, body, streams, _ChatShape(service, streams))

    @api.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest, cfg.max_body_bytes)
        params = completion_params(body, service)
        prompt = prompt_input(body.prompt)
        streams = await _submit(request, service, body, params, "prompt", **prompt)
        return await _respond(request, body, streams, _CompletionShape(service, streams))

    return api


async def _parse(request: Request, model: type[BaseModel], limit: int):
    try:
        return model.model_validate(await read_json(request, limit))
    except ValidationError as e:
        raise from_validation(e) from None


async def _submit(request: Request, service: EngineService, body: Sampling, params: SamplingParams,
                  param: str, **prompt) -> list:
    """One engine request per choice; if one cannot be queued, the others are aborted."""
    label = (body.user or "").strip()[:32] or None
    client = client_of(request.headers, request.client.host if request.client else None)
    streams = []
    try:
        for i in range(body.n or 1):
            p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
            streams.append(await service.submit(**prompt, params=p, label=label, client=client))
    except BaseException as e:
        for s in streams:
            s.close("another choice of the same request failed")
        error = admission_error(e, param)
        if error is None:
            raise
        raise error from None
    return streams


async def _respond(request: Request, body: Sampling, streams: list, shape):
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        every_chunk = bool(options and options.include_usage and options.continuous_usage_stats)
        return AbortOnDisconnect(_sse(streams, shape, include_usage, every_chunk), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(request, streams, shape)


class _ChatShape:
    """How a chat completion, and each of its stream chunks, reads."""
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, service: EngineService, streams: list):
        self.meta = {"id": f"chatcmpl-{streams[0].id}", "created": int(time.time()), "model": service.model_name}

    def choice(self, i: int, text: str, finish_reason: str | None, logprobs: list | None) -> dict:
        return {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                "logprobs": self.logprobs(i, logprobs)}

    def start(self, i: int) -> dict | None:
        return {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}

    def piece(self, i: int, text: str, finish_reason: str | None, logprobs: list | None) -> dict:
        return {"index": i, "delta": {"content": text} if text or logprobs else {},
                "finish_reason": finish_reason, "logprobs": self.logprobs(i, logprobs)}

    @staticmethod
    def logprobs(i: int, tokens: list[TokenLogprob] | None) -> dict | None:
        if tokens is None:
            return None
        entry = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode())}
        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                            for x in tokens], "refusal": None}


class _CompletionShape:
    """How a text completion, and each of its stream chunks, reads (the legacy logprobs format)."""
    object = chunk_object = "text_completion"

    def __init__(self, service: EngineService, streams: list):
        self.meta = {"id": f"cmpl-{streams[0].id}", "created": int(time.time()), "model": service.model_name}
        self.offsets = [0] * len(streams)           # text_offset of each choice's next token

    def choice(self, i: int, text: str, finish_reason: str | None, logprobs: list | None) -> dict:
        return {"index": i, "text": text, "logprobs": self.logprobs(i, logprobs), "finish_reason": finish_reason}

    def start(self, i: int) -> dict | None:
        return None

    piece = choice

    def logprobs(self, i: int, tokens: list[TokenLogprob] | None) -> dict | None:
        if tokens is None:
            return None
        offsets = []
        for x in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(x.token)
        return {"tokens": [x.token for x in tokens], "token_logprobs": [x.logprob for x in tokens],
                "top_logprobs": [dict(x.top) for x in tokens], "text_offset": offsets}


async def _collect(stream) -> tuple[str, list | None]:
    """A whole reply: its text and, when asked for, its tokens' logprobs."""
    text, logprobs = [], None
    async for d in stream:
        text.append(d.text)
        if d.logprobs is not None:
            logprobs = (logprobs or []) + d.logprobs
    return "".join(text), logprobs


async def _complete(request: Request, streams: list, shape) -> JSONResponse:
    """Wait for every choice; a client that hangs up first aborts them all."""
    try:
        replies = asyncio.ensure_future(asyncio.gather(*map(_collect, streams)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({replies, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not replies.done():
            replies.cancel()
            return JSONResponse({}, status_code=499)    # nobody is left to read it
        results = replies.result()
    finally:
        for s in streams:
            s.close()
    for s in streams:
        if s.finish_reason == "error" or (s.finish_reason == "abort" and s.error):
            raise APIError(failure_status(s.failure)[0], s.error or "the request failed")
    choices = [shape.choice(i, text, s.finish_reason, lp) for i, ((text, lp), s) in enumerate(zip(results, streams))]
    return JSONResponse({**shape.meta, "object": shape.object, "choices": choices, "usage": _usage(streams)})


async def _merged(streams: list):
    """(choice index, delta) from every choice, in the order they arrive."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        async for d in stream:
            queue.put_nowait((i, d))
        queue.put_nowait((i, None))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, d = await queue.get()
            if d is None:
                left -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()


async def _sse(streams: list, shape, include_usage: bool, every_chunk: bool = False):
    """every_chunk: vLLM's stream_options.continuous_usage_stats, the usage so far on each chunk."""
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def chunk(choice: dict) -> str:
        usage = {"usage": _usage(streams)} if every_chunk else {}
        return event({**shape.meta, "object": shape.chunk_object, "choices": [choice], **usage})

    try:                                    # closing early (client gone) aborts every choice
        for i in range(len(streams)):
            if (first := shape.start(i)) is not None:
                yield chunk(first)
        failed = False
        async for i, d in _merged(streams):
            if d.error:
                code = failure_status(streams[i].failure)[1]
                yield event({"error": {"message": d.error, "type": "server_error", "param": None, "code": code}})
                failed = True
                break
            if d.text or d.logprobs:
                yield chunk(shape.piece(i, d.text, None, d.logprobs))
            if d.finish_reason:
                yield chunk(shape.piece(i, "", d.finish_reason, None))
        if include_usage and not failed:
            yield event({**shape.meta, "object": shape.chunk_object, "choices": [], "usage": _usage(streams)})
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.close()


def _usage(streams: list) -> dict:
    """The prompt counts once, however many choices (as OpenAI bills it); completions add up."""
    prompt, completion = streams[0].prompt_tokens, sum(s.completion_tokens for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": streams[0].cached_tokens}}


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
