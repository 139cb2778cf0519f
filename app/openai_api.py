"""OpenAI-compatible routes: GET /v1/models, POST /v1/chat/completions and /v1/completions
(streaming or not; n choices, stop, seed, logprobs, usage with prefix-cache hits).

Requests are checked strictly, as OpenAI's API does: wrong types, unknown
arguments and unsupported features get a 400 that names the parameter, never
a silent ignore. The official `openai` package and curl work unchanged (any
API key is accepted).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from app.errors import APIError, from_validation, read_json
from app.rate_limit import client_of
from app.request_stream import TokenLogprob
from app.service import EngineService, QueueFull, ServiceUnavailable
from engine import SamplingParams
from engine.sampling_params import MAX_LOGPROBS

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


class Sampling(BaseModel):
    """What chat and text completions share."""
    model_config = STRICT
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None          # vLLM extension
    ignore_eos: bool = False          # vLLM extension: fixed-length replies for benchmarks
    stop: Any = None                  # a string or a list of up to 4 strings
    seed: int | None = None           # with n > 1, choice i samples with seed + i
    n: int | None = None
    user: str | None = None           # shown as the request's label on the live chart
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(Sampling):
    prompt: Any                       # a string, or a list of token ids
    logprobs: int | None = None       # legacy API: the number of alternatives per token
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


MAX_N = 8                             # choices per request; each is a request of its own in the engine


def router(service: EngineService) -> APIRouter:
    api = APIRouter()
    cfg = service.config

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "batchscope", "max_model_len": service.max_model_len}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, ChatRequest, cfg.max_body_bytes)
        params = _chat_params(body, service)
        messages = [_message(i, m) for i, m in enumerate(body.messages)]
        if not messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        streams = await _submit(request, service, body, params, "messages", messages=messages)
        return await _respond(request, body, streams, _ChatShape(service, streams))

    @api.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest, cfg.max_body_bytes)
        params = _completion_params(body, service)
        prompt = _prompt(body.prompt)
        streams = await _submit(request, service, body, params, "prompt", **prompt)
        return await _respond(request, body, streams, _CompletionShape(service, streams))

    return api


async def _parse(request: Request, model: type[BaseModel], limit: int):
    try:
        return model.model_validate(await read_json(request, limit))
    except ValidationError as e:
        raise from_validation(e) from None


def _reject_unsupported(checks: list[tuple[bool, str, str]]):
    for bad, param, why in checks:
        if bad:
            raise APIError(400, why, param=param)


def _sampling_params(body: Sampling, service: EngineService, max_tokens: int | None, param: str,
                     default_max_tokens: int, logprobs: int | None) -> SamplingParams:
    """Check what both APIs share and build the engine's SamplingParams."""
    cfg = service.config
    if body.model is not None and body.model != service.model_name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{service.model_name}'.", param="model", code="model_not_found")
    _reject_unsupported([
        (body.n is not None and not 1 <= body.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}"),
        (bool(body.presence_penalty), "presence_penalty", "penalties are not supported"),
        (bool(body.frequency_penalty), "frequency_penalty", "penalties are not supported"),
        (bool(body.logit_bias), "logit_bias", "logit_bias is not supported"),
        (body.stream_options is not None and not body.stream, "stream_options",
         "stream_options is only allowed when stream is true")])
    if max_tokens is None:
        max_tokens = min(default_max_tokens, cfg.max_tokens_cap)
    elif max_tokens < 1:
        raise APIError(400, f"{param} must be at least 1, got {max_tokens}", param=param)
    elif max_tokens > cfg.max_tokens_cap:
        raise APIError(400, f"{param} is {max_tokens}; this server allows at most {cfg.max_tokens_cap}",
                       param=param)
    stops = [body.stop] if isinstance(body.stop, str) else [] if body.stop is None else body.stop
    _reject_unsupported([
        (body.temperature is not None and not 0 <= body.temperature <= 2, "temperature",
         "temperature must be between 0 and 2"),
        (body.top_p is not None and not 0 < body.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
        (body.top_k is not None and body.top_k < 0, "top_k", "top_k must be >= 0"),
        (body.seed is not None and not -2**63 <= body.seed < 2**64, "seed", "seed must fit in 64 bits"),
        (not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(x, str) and x for x in stops),
         "stop", "stop must be a string or a list of up to 4 non-empty strings")])
    return SamplingParams(max_tokens=max_tokens, stop=stops, ignore_eos=body.ignore_eos,
                          temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                          seed=body.seed, logprobs=logprobs)


def _chat_params(body: ChatRequest, service: EngineService) -> SamplingParams:
    _reject_unsupported([
        (body.top_logprobs is not None and not body.logprobs, "top_logprobs",
         "top_logprobs needs logprobs: true"),
        (body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS, "top_logprobs",
         f"top_logprobs must be between 0 and {MAX_LOGPROBS}"),
        (bool(body.tools), "tools", "tools are not supported"),
        (body.tool_choice not in (None, "none"), "tool_choice", "tool_choice needs tools, which are not supported"),
        (body.parallel_tool_calls is not None, "parallel_tool_calls",
         "parallel_tool_calls needs tools, which are not supported"),
        (body.response_format not in (None, {"type": "text"}), "response_format",
         "only response_format {'type': 'text'} is supported"),
        (bool(body.store), "store", "this server does not store completions"),
        (bool(body.metadata), "metadata", "metadata goes with stored completions, which this server does not keep"),
        (body.service_tier not in (None, "auto", "default"), "service_tier",
         "only service_tier 'auto' or 'default' is supported")])
    by_new_name = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if by_new_name else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _sampling_params(body, service, max_tokens, "max_completion_tokens" if by_new_name else "max_tokens",
                            service.config.default_max_tokens, logprobs)


def _completion_params(body: CompletionRequest, service: EngineService) -> SamplingParams:
    _reject_unsupported([
        (body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS, "logprobs",
         f"logprobs must be between 0 and {MAX_LOGPROBS}"),
        (bool(body.echo), "echo", "echo is not supported"),
        (bool(body.suffix), "suffix", "suffix is not supported"),
        (body.best_of not in (None, 1), "best_of", "only best_of=1 is supported")])
    # 16 is OpenAI's (and vLLM's) default for text completions
    return _sampling_params(body, service, body.max_tokens, "max_tokens", 16, body.logprobs)


def _prompt(prompt) -> dict:
    """A string, or a list of token ids; several prompts in one request are not supported."""
    if isinstance(prompt, str) and prompt:
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt(prompt[0])
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "only one prompt per request is supported; send one request per prompt",
                       param="prompt")
    raise APIError(400, "prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


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
        if isinstance(e, ValueError):
            code = "context_length_exceeded" if "limit is" in str(e) else None
            raise APIError(400, str(e), param=param, code=code) from None
        if isinstance(e, QueueFull):
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        if isinstance(e, ServiceUnavailable):
            raise APIError(503, str(e), code="service_unavailable") from None
        raise
    return streams


async def _respond(request: Request, body: Sampling, streams: list, shape):
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return AbortOnDisconnect(_sse(streams, shape, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(request, streams, shape)


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
            status = 503 if "shutting down" in (s.error or "") else 500
            raise APIError(status, s.error or "the request failed")
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


async def _sse(streams: list, shape, include_usage: bool):
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def chunk(choice: dict) -> str:
        return event({**shape.meta, "object": shape.chunk_object, "choices": [choice]})

    try:                                    # closing early (client gone) aborts every choice
        for i in range(len(streams)):
            if (first := shape.start(i)) is not None:
                yield chunk(first)
        failed = False
        async for i, d in _merged(streams):
            if d.error:
                code = "service_unavailable" if "shutting down" in d.error else "server_error"
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
