"""Attach mode: the page over a vLLM server instead of batchscope's own engine.

    batchscope serve --attach http://127.0.0.1:8000            # records at 127.0.0.1:8765 (+1 per engine)
    batchscope serve --attach http://gpu-box:8000 --attach-records gpu-box:9000

AttachedService stands where EngineService stands (app/serving/service.py), on the same base
(app/serving/front.py), with no engine of its own:
  - records: vLLM's recording scheduler (integrations/vllm) streams them (app/serving/attach_records.py);
    they reach the viewers, traces and metrics exactly as the own engine's do;
  - chats: every request (the page's chats, /join students, this app's /v1 API) is relayed to
    vLLM's OpenAI API, streamed back as a RequestStream; the request's label travels as its
    `request_id` (and `user`), which the recorder shows as the request's name;
  - settings: vLLM fixes its scheduler settings when it starts, so they are shown read-only
    with the values in force, and a change is refused with that reason;
  - the what-if replay needs each prompt's token ids, which vLLM does not publish: it is refused.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from app.config import ServerConfig
from app.replay.arrival_log import ArrivalLog
from app.serving.attach_records import Lanes, RecordsUnavailable
from app.serving.front import Delta, QueueFull, RequestStream, ServiceFront, ServiceUnavailable
from app.serving.rate_limit import Caller
from engine import EngineConfig, SamplingParams
from engine.memory import resident_bytes

log = logging.getLogger("batchscope.attach")
DEFAULT_RECORDS_PORT = 8765
READ_ONLY = ("vLLM fixes its scheduler settings when it starts: restart vLLM with other flags "
             "(--max-num-batched-tokens, --max-num-seqs, --long-prefill-token-threshold, "
             "--enable-chunked-prefill / --no-enable-chunked-prefill) to change them")


@dataclass(frozen=True)
class AttachConfig:
    url: str                                # vLLM's OpenAI server: http://HOST:PORT
    records: str | None = None              # HOST:PORT of the first engine's record stream
    timeout_s: float = 10.0                 # to reach vLLM and its recorder at start

    def __post_init__(self):
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--attach needs vLLM's address as http://HOST:PORT, got {self.url!r}")
        if self.records is not None:
            host, _, port = self.records.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--attach-records needs HOST:PORT, got {self.records!r}")

    @property
    def base(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def records_address(self) -> tuple[str, int]:
        if self.records is None:
            return urlsplit(self.url).hostname, DEFAULT_RECORDS_PORT
        host, _, port = self.records.rpartition(":")
        return host, int(port)


class NoArrivalLog(ArrivalLog):
    def window(self, since_step: int = 0):
        from app.replay.whatif import WhatIfError
        raise WhatIfError("the what-if replay needs each prompt's token ids, which an attached vLLM server does "
                          "not publish; run batchscope's own engine (without --attach) to replay a class")


class _Idle:
    """What the what-if route pokes on the own engine's loop; here there is nothing to wake."""
    def wake(self):
        pass


class AttachedService(ServiceFront):
    def __init__(self, attach: AttachConfig, config: ServerConfig | None = None):
        super().__init__(config, NoArrivalLog())    # cuda_graphs stays None: vLLM keeps its own graphs
        self.attach = attach
        self.engine_config = EngineConfig()     # only named by the what-if route, which refuses here
        self.whatif, self.loop, self.engine = None, _Idle(), None
        self.step_delay, self.crashes, self.last_error = 0.0, 0, None
        self.engine_name = None
        self.fixed: dict = {}                   # the recorder's other settings (prefix caching, async scheduling...)
        self.t0 = time.time()
        host, port = attach.records_address
        self.lanes = Lanes(host, port, self._on_record, self.t0)
        self.latest: dict = {}                  # the last step record: queue sizes for /api/engine
        self._streams: dict[str, tuple[RequestStream, asyncio.Task]] = {}
        self._ids = 0

    # ================= lifecycle =================
    def start(self, timeout: float | None = None):
        """Reach vLLM and its recorder; raises ConnectionError saying which is missing and what to do.
        Once attached, a second call (the app's lifespan after `python -m app` started it) does nothing."""
        if self.accepting:
            return
        timeout = timeout or self.attach.timeout_s
        try:
            r = httpx.get(f"{self.attach.base}/v1/models", timeout=timeout, trust_env=False)
            r.raise_for_status()
            model = r.json()["data"][0]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ConnectionError(f"vLLM does not answer at {self.attach.base}/v1/models ({_why(e)}); "
                                  f"start it first (docs/vllm.md) or fix --attach") from None
        self.model_name, self.max_model_len = model["id"], model.get("max_model_len") or 0
        self.lanes.start(timeout)               # RecordsUnavailable is a ConnectionError
        hello = self.lanes.hello
        s = hello["settings"]
        self.settings = {k: s.get(k) for k in ("policy", "max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk")}
        self.fixed = {k: v for k, v in s.items() if k not in self.settings}
        self.engine_name = hello.get("engine")
        self.device, _, self.dtype = str(hello.get("device", "")).partition("/")
        self.metrics.attach(self.model_name, self.max_model_len, self.dtype)   # /metrics: from vLLM's records
        self._on_record({"type": "policy", "step": 0, "t": 0.0, **self.settings, "engine": self.engine_name})
        self.accepting = True

    def begin_shutdown(self, reason: str = "server shutting down"):
        self.accepting = False
        for stream, task in list(self._streams.values()):
            stream.loop.call_soon_threadsafe(task.cancel)

    def stop(self, timeout: float = 10.0):
        self.begin_shutdown()
        self.lanes.stop()
        self.broadcaster.close_all_threadsafe()

    @property
    def loaded(self) -> bool:
        return self.accepting

    def memory(self) -> dict:
        """This process's resident memory; the KV cache lives in vLLM's processes, which it does not read."""
        return {"rss_bytes": resident_bytes(), "kv_cache_bytes": None}

    def health(self) -> tuple[bool, str]:
        if not self.accepting:
            return False, "not attached"
        if not self.lanes.healthy:
            return False, "; ".join(self.lanes.errors.values())
        return True, "ok"

    def describe(self) -> dict:
        return {**super().describe(), "engine": self.engine_name, "attached": self.attach.base,
                "lanes": self.lanes.lanes, "read_only": READ_ONLY}

    def _on_record(self, obj: dict):
        """A lane thread (or start): what the own engine's listener does, minus the arrival log."""
        if obj.get("type") == "step":
            self.latest = obj
        self.metrics.observe(obj)
        self.broadcaster.publish(obj)
        self.broadcaster.flush()

    # ================= requests, relayed to vLLM =================
    async def submit(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                     label: str | None = None, client: Caller | None = None) -> RequestStream:
        """As EngineService.submit: ValueError (vLLM refused the request), QueueFull, ServiceUnavailable."""
        if not self.accepting:
            raise ServiceUnavailable("not attached to vLLM")
        self.check_rate(client)
        self._ids += 1
        stream = RequestStream(asyncio.get_running_loop(), self._abort_stream)
        stream.id, stream.label = f"v{self._ids}", label or f"v{self._ids}"
        path, body = _body(self.model_name, stream.label, params or SamplingParams(), messages, prompt,
                           prompt_token_ids)
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), trust_env=False)
        try:
            resp = await http.send(http.build_request("POST", f"{self.attach.base}{path}", json=body), stream=True)
        except httpx.HTTPError as e:
            await http.aclose()
            raise ServiceUnavailable(f"vLLM at {self.attach.base} is unreachable ({_why(e)})") from None
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            await resp.aclose()
            await http.aclose()
            message = f"vLLM refused the request: {_message(text)}"
            if resp.status_code == 429:
                raise QueueFull(message, self.config.retry_after_s)
            if resp.status_code >= 500:
                raise ServiceUnavailable(message)
            raise ValueError(message)
        task = asyncio.ensure_future(self._relay(stream, http, resp))
        self._streams[stream.id] = (stream, task)
        return stream

    async def _relay(self, stream: RequestStream, http: httpx.AsyncClient, resp: httpx.Response):
        """vLLM's server-sent events -> the stream's deltas; one delta per event with text."""
        tokens, finish, error = 0, None, None
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    finish, error = "error", _message(json.dumps(chunk))
                    break
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    tokens = usage.get("completion_tokens", tokens)
                    stream.prompt_tokens = usage.get("prompt_tokens", 0)
                    stream.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if text:
                        tokens += 1
                        stream.queue.put_nowait(Delta(stream.id, text, [], tokens))
                    finish = choice.get("finish_reason") or finish
            finish = finish or "error"
            error = error or (None if finish in ("stop", "length") else "vLLM ended the stream without a reason")
        except asyncio.CancelledError:
            finish, error = "abort", getattr(stream, "abort_reason", None) or "aborted"
        except (httpx.HTTPError, ValueError) as e:
            finish, error = "error", f"the stream from vLLM broke: {_why(e)}"
        finally:
            await resp.aclose()
            await http.aclose()
            self._streams.pop(stream.id, None)
            stream.queue.put_nowait(Delta(stream.id, "", [], tokens, finish_reason=finish, error=error,
                                          cached_tokens=stream.cached_tokens))

    def _abort_stream(self, stream: RequestStream, reason: str):
        """Any thread: closing the HTTP stream makes vLLM abort the request and free its KV blocks."""
        entry = self._streams.get(stream.id)
        if entry is not None:
            stream.abort_reason = reason
            stream.loop.call_soon_threadsafe(entry[1].cancel)

    def abort(self, request_id: str, reason: str = "aborted"):
        entry = self._streams.get(request_id)
        if entry is not None:
            self._abort_stream(entry[0], reason)

    # ================= settings: read-only =================
    async def set_policy(self, **changes) -> dict:
        raise ValueError(READ_ONLY)

    async def engine_state(self) -> dict:
        if not self.accepting:
            raise ServiceUnavailable("not attached to vLLM")
        last = self.latest
        return {**self.settings, **self.fixed, "model": self.model_name, "device": self.device, "dtype": self.dtype,
                "max_model_len": self.max_model_len, "kv": last.get("kv"), "waiting": last.get("waiting", 0),
                "running": last.get("running", 0), "step": last.get("step"), "step_delay": 0.0,
                "disaggregated": None, "engine": self.engine_name, "attached": self.attach.base,
                "lanes": self.lanes.lanes, "lane_errors": dict(self.lanes.errors), "read_only": READ_ONLY}

    async def call(self, fn: Callable, timeout: float | None = None):
        raise ServiceUnavailable("an attached vLLM server has no engine thread here")


def _body(model: str, label: str, p: SamplingParams, messages, prompt, prompt_token_ids) -> tuple[str, dict]:
    """The OpenAI request vLLM gets. request_id: the recorder names the request by it (and vLLM makes
    it unique with a suffix of its own)."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "request_id": label,
            "user": label, "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "ignore_eos": p.ignore_eos}
    if p.top_k:
        body["top_k"] = p.top_k
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = p.stop
    if p.stop_token_ids:
        body["stop_token_ids"] = p.stop_token_ids
    if messages is not None:
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": prompt if prompt is not None else prompt_token_ids}


def _message(text: str) -> str:
    try:
        obj = json.loads(text)
        err = obj.get("error", obj)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    except (ValueError, AttributeError):
        return text[:500]


def _why(e: BaseException) -> str:
    return str(e) or type(e).__name__


__all__ = ["AttachConfig", "AttachedService", "RecordsUnavailable"]
