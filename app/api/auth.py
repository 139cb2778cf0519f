"""The presenter key: the one check behind every route and page control that changes the engine
or reads private data (the arrival log). The key is compared in constant time and never echoed."""
from __future__ import annotations

import hmac

from fastapi import Request

from app.api.errors import APIError


def key_matches(wanted: str | None, given: str | None) -> bool:
    """True when no presenter key is set, or `given` is it."""
    return wanted is None or hmac.compare_digest((given or "").encode(), wanted.encode())


def require_presenter(request: Request, wanted: str | None, needs: str):
    """APIError 403 unless the request's X-Presenter-Key header is the key. needs: what asks for it
    (`changing the engine`), for the message."""
    if not key_matches(wanted, request.headers.get("x-presenter-key")):
        raise APIError(403, f"{needs} needs the presenter key (X-Presenter-Key header)", code="presenter_key_required")
