"""OpenAI-style errors and JSON bodies read within a size limit.

Every 4xx/5xx of the JSON API has OpenAI's shape, so the official client and
curl users see a message that names the problem:
    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from engine.errors import PromptTooLong, QueueFull, ServiceUnavailable, ShuttingDown

_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def admission_error(e: BaseException, param: str | None = None) -> APIError | None:
    """The HTTP answer to a request the service did not admit, by the error's type (engine/errors.py);
    None for any other error. param: the request field a bad prompt came in."""
    if isinstance(e, PromptTooLong):
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=param)
    if isinstance(e, QueueFull):
        return APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, ServiceUnavailable):
        return APIError(503, str(e), code="service_unavailable")
    return None


def failure_status(failure: BaseException | None) -> tuple[int, str]:
    """Status and error code of a request that failed after it was admitted: 503 when the server's end
    stopped it (the stream's failure is ShuttingDown), 500 for an engine error."""
    if isinstance(failure, ShuttingDown):
        return 503, "service_unavailable"
    return 500, "server_error"


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; APIError 413 past `limit` bytes (checked while reading), 400 if malformed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def from_validation(error: ValidationError) -> APIError:
    """The first problem pydantic found, worded like OpenAI's API words it."""
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    kind = first["type"]
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param)
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    given = first.get("input")
    shown = json.dumps(given)[:80] if _jsonable(given) else type(given).__name__
    return APIError(400, f"Invalid value for '{param}': {first['msg']} (got {shown}).", param=param)


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
