"""OpenAI request bodies, checked strictly as OpenAI's API checks them, and turned into the engine's inputs.

Wrong types, unknown arguments and unsupported features get a 400 that names
the parameter, never a silent ignore.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from app.api.errors import APIError
from app.serving.service import EngineService
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
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM extension: usage so far on every chunk


class Sampling(BaseModel):
    """What chat and text completions share."""
    model_config = STRICT
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM extensions (engine/sampling_params.py), which benchmark clients send
    top_k: int | None = None
    ignore_eos: bool = False          # fixed-length replies for benchmarks
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    skip_special_tokens: bool = True
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


def reject_unsupported(checks: list[tuple[bool, str, str]]):
    for bad, param, why in checks:
        if bad:
            raise APIError(400, why, param=param)


def sampling_params(body: Sampling, service: EngineService, max_tokens: int | None, param: str,
                     default_max_tokens: int, logprobs: int | None) -> SamplingParams:
    """Check what both APIs share and build the engine's SamplingParams."""
    cfg = service.config
    if body.model is not None and body.model != service.model_name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{service.model_name}'.", param="model", code="model_not_found")
    reject_unsupported([
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
    reject_unsupported([
        (body.temperature is not None and not 0 <= body.temperature <= 2, "temperature",
         "temperature must be between 0 and 2"),
        (body.top_p is not None and not 0 < body.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
        (body.top_k is not None and body.top_k < 0, "top_k", "top_k must be >= 0"),
        (body.seed is not None and not -2**63 <= body.seed < 2**64, "seed", "seed must fit in 64 bits"),
        (body.min_tokens is not None and not 0 <= body.min_tokens <= max_tokens, "min_tokens",
         f"min_tokens must be between 0 and the request's max_tokens ({max_tokens})"),
        (body.repetition_penalty is not None and not 0 < body.repetition_penalty <= 100, "repetition_penalty",
         "repetition_penalty must be in (0, 100]"),
        (body.min_p is not None and not 0 <= body.min_p <= 1, "min_p", "min_p must be between 0 and 1"),
        (not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(x, str) and x for x in stops),
         "stop", "stop must be a string or a list of up to 4 non-empty strings")])
    return SamplingParams(max_tokens=max_tokens, stop=stops, ignore_eos=body.ignore_eos,
                          temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                          seed=body.seed, logprobs=logprobs, min_tokens=body.min_tokens or 0,
                          repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                          min_p=body.min_p or 0.0, skip_special_tokens=body.skip_special_tokens)


def chat_params(body: ChatRequest, service: EngineService) -> SamplingParams:
    reject_unsupported([
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
    return sampling_params(body, service, max_tokens, "max_completion_tokens" if by_new_name else "max_tokens",
                            service.config.default_max_tokens, logprobs)


def completion_params(body: CompletionRequest, service: EngineService) -> SamplingParams:
    reject_unsupported([
        (body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS, "logprobs",
         f"logprobs must be between 0 and {MAX_LOGPROBS}"),
        (bool(body.echo), "echo", "echo is not supported"),
        (bool(body.suffix), "suffix", "suffix is not supported"),
        (body.best_of not in (None, 1), "best_of", "only best_of=1 is supported")])
    # 16 is OpenAI's (and vLLM's) default for text completions
    return sampling_params(body, service, body.max_tokens, "max_tokens", 16, body.logprobs)


def prompt_input(prompt) -> dict:
    """A string, or a list of token ids; several prompts in one request are not supported."""
    if isinstance(prompt, str) and prompt:
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt_input(prompt[0])
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "only one prompt per request is supported; send one request per prompt",
                       param="prompt")
    raise APIError(400, "prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


def message(i: int, m: Message) -> dict:
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
