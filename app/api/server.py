"""create_app(service) -> the FastAPI app: health, metrics, engine control, traces, the step stream, /v1.

`/` is left free for the Gradio UI, which mounts on the same app:
    app = create_app(service); gr.mount_gradio_app(app, blocks, path="/")
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException

from app.api import openai_api, whatif_api
from app.api.auth import require_presenter
from app.api.errors import APIError, from_validation, read_json
from app.readers.trace import chrome_trace
from app.serving.broadcast import Entry, Subscription, TooManySubscribers
from app.serving.service import EngineService, ServiceUnavailable

log = logging.getLogger("batchscope.server")
MAX_WS_MESSAGE = 4096       # viewers only send small control messages


class EngineUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    policy: str | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_prefill_chunk: int | None = None    # null switches the cap off; leave it out to keep it
    enable_prefix_caching: bool | None = None   # false drops the prefix cache's table (vLLM's --no-enable-...)
    max_kv_blocks: int | None = None        # cap on KV blocks in use; null: every block; leave it out to keep it
    step_delay: float | None = None
    speculative_config: dict | None = None  # vLLM's form; null switches speculation off; leave it out to keep it


def create_app(service: EngineService, manage_service: bool = True) -> FastAPI:
    """manage_service: start the service (load the model) on startup and stop it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_service:
            await asyncio.to_thread(service.start)
        yield
        service.begin_shutdown()
        service.broadcaster.close_all()
        if manage_service:
            await asyncio.to_thread(service.stop)

    app = FastAPI(title="batchscope", lifespan=lifespan, docs_url="/api/docs", redoc_url=None,
                  openapi_url="/api/openapi.json")
    app.state.service = service
    cfg = service.config
    _add_error_handlers(app)
    app.include_router(openai_api.router(service))
    app.include_router(whatif_api.router(service))     # presenter only: replays the arrival log

    @app.get("/healthz")
    @app.get("/health")                     # vLLM's name, which benchmark clients probe before they start
    async def healthz():
        ok, reason = service.health()
        body = {"status": "ok" if ok else "unhealthy", "model": service.model_name, "device": service.device,
                "cuda_graphs": service.cuda_graphs, "memory": service.memory()}
        return body if ok else JSONResponse({**body, "reason": reason}, status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])     # HEAD: scrapers and benchmark clients probe it
    async def metrics():
        """Prometheus text format; vLLM's metric names where they mean the same (app/serving/prometheus.py)."""
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/engine")
    async def get_engine():
        try:
            state = await service.engine_state()
        except ServiceUnavailable as e:
            raise APIError(503, str(e)) from None
        hub = service.broadcaster
        return {**state, "server": {
            "presenter_key_required": cfg.presenter_key is not None, "viewers": hub.num_subscribers,
            "max_viewers": cfg.max_ws_subscribers, "viewer_records_dropped": hub.dropped,
            "max_waiting": cfg.max_waiting, "max_tokens_cap": cfg.max_tokens_cap,
            "engine_loop_crashes": service.crashes, "last_engine_error": service.last_error}}

    @app.post("/api/engine")
    async def post_engine(request: Request):
        require_presenter(request, cfg.presenter_key, "changing the engine")
        try:
            update = EngineUpdate.model_validate(await read_json(request, cfg.max_body_bytes))
        except ValidationError as e:
            raise from_validation(e) from None
        changes = update.model_dump(exclude_unset=True)
        if not changes:
            raise APIError(400, f"nothing to change; send any of {sorted(EngineUpdate.model_fields)}")
        try:
            return await service.set_policy(**changes)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    @app.get("/api/trace")
    async def trace(last: str = "200", format: str = "json"):
        if not last.isdigit() or not 1 <= int(last) <= cfg.history:
            raise APIError(400, f"last must be an integer in [1, {cfg.history}], got {last!r}", param="last")
        if format not in ("json", "chrome"):
            raise APIError(400, f"format must be json or chrome, got {format!r}", param="format")
        _, records = service.ring.last_steps(int(last))
        meta = service.describe()
        if format == "chrome":
            return JSONResponse(chrome_trace(records, meta),
                                headers={"Content-Disposition": 'attachment; filename="batchscope-trace.json"'})
        return {**meta, "records": records}

    @app.websocket("/ws/steps")
    async def ws_steps(ws: WebSocket):
        await ws.accept()
        try:
            sub = service.broadcaster.subscribe(cfg.snapshot_steps)
        except TooManySubscribers as e:
            await ws.send_text(json.dumps(APIError(429, str(e), code="too_many_viewers").body() | {"type": "error"}))
            await ws.close(code=1013)           # "try again later"
            return
        tasks = [asyncio.ensure_future(_send_loop(ws, sub)), asyncio.ensure_future(_receive_loop(ws, sub))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sub.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _receive_loop(ws: WebSocket, sub: Subscription):
        """Control messages: {"type": "ping"} and {"type": "snapshot", "last": N}; anything else is an error."""
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            try:
                _control(sub, msg.get("text"))
            except APIError as e:
                sub.post(e.body() | {"type": "error"})
            await asyncio.sleep(0)              # let the sender answer before the next message arrives

    def _control(sub: Subscription, text: str | None):
        if text is None:
            raise APIError(400, "binary messages are not supported; send JSON text")
        if len(text) > MAX_WS_MESSAGE:
            raise APIError(400, f"message longer than {MAX_WS_MESSAGE} characters")
        try:
            msg = json.loads(text)
        except json.JSONDecodeError as e:
            raise APIError(400, f"message is not valid JSON: {e}") from None
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "ping":
            return sub.post({"type": "pong"})
        if kind == "snapshot":
            last = msg.get("last", cfg.snapshot_steps)
            if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= cfg.history:
                raise APIError(400, f"snapshot 'last' must be an integer in [1, {cfg.history}]", param="last")
            return sub.request_snapshot(last)
        raise APIError(400, f"unknown message {text[:60]!r}; send {{\"type\": \"ping\"}} or "
                            f"{{\"type\": \"snapshot\", \"last\": N}}", param="type")

    return app


async def _send_loop(ws: WebSocket, sub: Subscription):
    try:
        while (items := await sub.get()) is not None:
            for x in items:
                await ws.send_text(x.text if isinstance(x, Entry) else json.dumps(x))
        await ws.close(code=1001)               # the server is going away
    except Exception:                            # the viewer went away mid-send
        pass


def _add_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return APIError(400, f"invalid request: {e.errors()[0].get('msg')}").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}").response()
