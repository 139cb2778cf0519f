"""`python -m app`: load the model, then serve everything on one port.

Every flag can also come from the environment as BATCHSCOPE_<FLAG> (for
example BATCHSCOPE_MODEL, BATCHSCOPE_STEP_DELAY); HOST and PORT are honoured
too, as hosting platforms set them. The presenter key comes only from the
environment (PRESENTER_KEY), never from a flag: command lines are visible to
every user of the machine. So do API keys (BATCHSCOPE_API_KEY, comma-separated):
when set, /v1 needs `Authorization: Bearer <key>` and each key has its own rate limit.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys

import uvicorn

from app.api.server import create_app
from app.config import ServerConfig
from app.serving.service import EngineService
from app.ui.plain_page import gradio_installed, mount_plain
from engine import EngineConfig
from engine.config import POLICIES
from engine.memory import freeze_survivors
from engine.scheduling.ngram import SpeculativeConfig

# flag -> (config class, field, help). Defaults come from the dataclasses, so they are written down once.
FLAGS = {
    "host": (ServerConfig, "host", "address to listen on"),
    "port": (ServerConfig, "port", "port to listen on (0: any free port)"),
    "model": (EngineConfig, "model", "local folder or Hub id; default: the embedded SmolLM2-135M-Instruct"),
    "device": (EngineConfig, "device", "auto, cpu or cuda"),
    "dtype": (EngineConfig, "dtype", "auto, float32, bfloat16 or float16"),
    "policy": (EngineConfig, "policy", "static, continuous or chunked, at start"),
    "max-num-batched-tokens": (EngineConfig, "max_num_batched_tokens", "token budget of one step"),
    "max-num-seqs": (EngineConfig, "max_num_seqs", "most sequences in one step"),
    "max-prefill-chunk": (EngineConfig, "max_prefill_chunk", "cap on one prompt's chunk (chunked policy)"),
    "kv-cache-gb": (EngineConfig, "kv_cache_gb", "KV cache size on CPU"),
    "claim-kv-cache": (EngineConfig, "claim_kv_cache",
                       "CPU: make the whole KV cache resident at start, so RSS is flat and a cache too large fails "
                       "at once; --no-claim-kv-cache leaves its pages to be touched when first used"),
    "enable-prefix-caching": (EngineConfig, "enable_prefix_caching",
                              "reuse the KV of prompts that start alike; --no-enable-prefix-caching as vLLM "
                              "(switchable live: POST /api/engine)"),
    "block-size": (EngineConfig, "block_size", "tokens per KV block"),
    "attention-backend": (EngineConfig, "attention_backend", "auto, torch, triton or flash_attn"),
    "enforce-eager": (EngineConfig, "enforce_eager", "CUDA: no CUDA graphs, no torch.compile (1/true to set)"),
    "cpu-threads": (EngineConfig, "cpu_threads",
                    "torch threads on CPU; default: one per core (1 helps on a busy 2-core box)"),
    "max-model-len": (EngineConfig, "max_model_len", "context length; default: the model's"),
    "speculative-config": (EngineConfig, "speculative_config",
                           "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                           "\"prompt_lookup_max\": 4}'; default: off"),
    "step-delay": (ServerConfig, "step_delay", "seconds of pause after each step (slow motion)"),
    "served-model-name": (ServerConfig, "served_model_name", "model name shown by /v1/models"),
    "public-url": (ServerConfig, "public_url", "address students reach this server at, for the projector's join link "
                                               "(default: the LAN address when --host is 0.0.0.0)"),
    "max-waiting": (ServerConfig, "max_waiting", "queued requests beyond which chat answers 429"),
    "max-tokens-cap": (ServerConfig, "max_tokens_cap", "largest max_tokens a request may ask for"),
    "default-max-tokens": (ServerConfig, "default_max_tokens", "max_tokens when a request gives none"),
    "max-body-bytes": (ServerConfig, "max_body_bytes", "largest JSON request body"),
    "max-viewers": (ServerConfig, "max_ws_subscribers", "step-stream viewers at once"),
    "viewer-buffer": (ServerConfig, "ws_buffer", "records a viewer may fall behind before a gap"),
    "history": (ServerConfig, "history", "records kept for snapshots and traces"),
    "rate-limit-per-minute": (ServerConfig, "rate_limit_per_minute",
                              "chat requests a minute per caller (room member, API key, else address); 0: off"),
    "rate-limit-burst": (ServerConfig, "rate_limit_burst", "of which this many at once"),
    "forwarded-allow-ips": (ServerConfig, "forwarded_allow_ips",
                            "proxies whose X-Forwarded-For is believed: comma-separated IPs or networks, "
                            "'*' for any peer, '' for none (env FORWARDED_ALLOW_IPS too)"),
}
# --serving: throughput settings instead of the teaching ones (a 256-token budget, so that chunks show on
# the chart; a rate limit for a public room). Flags and environment variables still win.
SERVING = {"max_num_batched_tokens": 2048, "max_num_seqs": 64, "rate_limit_per_minute": 0}
# the server's own defaults where they differ from the library's dataclasses
APP = {"claim_kv_cache": True}
PLAIN_ENV = {"host": "HOST", "port": "PORT", "forwarded-allow-ips": "FORWARDED_ALLOW_IPS"}   # as platforms set them
def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def speculative_json(text: str) -> dict:
    """--speculative-config's JSON object, checked as EngineConfig checks it (the error names the key)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    try:
        SpeculativeConfig.of(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


TYPES = {"int": int, "float": float, "int | None": int, "float | None": float, "bool": _bool,
         "dict | SpeculativeConfig | None": speculative_json}


def parse_args(argv: list[str] | None = None, env: dict | None = None,
               prog: str = "python -m app") -> argparse.Namespace:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog=prog, description="batchscope: a live LLM engine you can watch.")
    preset = dict(action="store_true", default=_bool(env.get("BATCHSCOPE_SERVING") or "0"))
    p.add_argument("--serving", **preset, help="serving preset: " + ", ".join(f"{k}={v}" for k, v in SERVING.items())
                   + " (env BATCHSCOPE_SERVING); flags and environment variables given still win")
    first = argparse.ArgumentParser(add_help=False)      # the preset decides the other flags' defaults
    first.add_argument("--serving", **preset)
    serving = first.parse_known_args(argv)[0].serving
    for flag, (cls, name, text) in FLAGS.items():
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        kind = TYPES.get(str(field.type), str)
        var = "BATCHSCOPE_" + flag.upper().replace("-", "_")
        raw = env.get(var) or (env.get(PLAIN_ENV[flag]) if flag in PLAIN_ENV else None)
        app_default = APP.get(name, field.default)
        default = SERVING.get(name, app_default) if serving else app_default
        if raw is not None:
            try:
                default = kind(raw)
            except ValueError:
                p.error(f"environment variable {var}={raw!r} is not a valid {kind.__name__}")
            except argparse.ArgumentTypeError as e:
                p.error(f"environment variable {var}: {e}")
        if flag in ("enable-prefix-caching", "claim-kv-cache"):   # vLLM's pairs of flags: --x / --no-x
            p.add_argument(f"--{flag}", dest=name, action=argparse.BooleanOptionalAction, default=default,
                           help=f"{text} (env {var}; default {app_default!r})")
            continue
        p.add_argument(f"--{flag}", dest=name, type=kind, default=default, metavar=flag.split("-")[-1].upper(),
                       choices=POLICIES if flag == "policy" else None,
                       help=f"{text} (env {var}; default {app_default!r})")
    # attach mode (app/serving/attach.py): the page over a vLLM server's records, no engine of its own
    p.add_argument("--attach", default=env.get("BATCHSCOPE_ATTACH"), metavar="URL",
                   help="draw a vLLM server (http://HOST:PORT) that runs batchscope's recording scheduler "
                        "instead of loading a model (env BATCHSCOPE_ATTACH); docs/vllm.md")
    p.add_argument("--attach-records", default=env.get("BATCHSCOPE_ATTACH_RECORDS"), metavar="HOST:PORT",
                   help="where its first engine publishes records (default: the --attach host, port 8765)")
    p.add_argument("--log-level", default=env.get("BATCHSCOPE_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def server_config(args: argparse.Namespace, env: dict | None = None) -> ServerConfig:
    """The flags' server settings, plus the secrets that come only from the environment."""
    env = os.environ if env is None else env
    values = vars(args)
    return ServerConfig(**{n: values[n] for c, n, _ in FLAGS.values() if c is ServerConfig},
                        presenter_key=env.get("PRESENTER_KEY") or None, api_keys=env.get("BATCHSCOPE_API_KEY", ""))


def build(args: argparse.Namespace, env: dict | None = None) -> tuple[EngineService, object]:
    """The service and the app. The Gradio UI mounts here, on the same app, in one line; where gradio
    is not installed, the chart-only page (app/ui/plain_page.py)."""
    values = vars(args)
    engine_config = EngineConfig(**{n: values[n] for c, n, _ in FLAGS.values() if c is EngineConfig})
    if args.attach:
        from app.serving.attach import AttachConfig, AttachedService
        service = AttachedService(AttachConfig(args.attach, args.attach_records), server_config(args, env))
    else:
        service = EngineService(engine_config, server_config(args, env))
    app = create_app(service)
    if gradio_installed():
        importlib.import_module("app.ui.page").mount_ui(app, service)   # the teaching UI at /; Gradio loads only here
    else:                                              # the chart, controls and API, without chat panels
        print("batchscope: gradio is not installed: serving the chart and the API without the chat panels",
              file=sys.stderr, flush=True)
        mount_plain(app, service)
    return service, app


class Server(uvicorn.Server):
    """uvicorn, plus: print the URL once listening, and abort in-flight requests on SIGINT/SIGTERM
    so that open streams end at once instead of holding the shutdown up."""

    def __init__(self, config: uvicorn.Config, service: EngineService):
        super().__init__(config)
        self.service = service

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"batchscope: serving {self.service.model_name} on {self.service.device} "
                  f"at http://{host}:{port}", flush=True)

    def handle_exit(self, sig, frame):
        self.service.begin_shutdown("server shutting down")
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None, prog: str = "python -m app") -> int:
    args = parse_args(argv, prog=prog)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        service, app = build(args)
    except ValueError as e:
        print(f"batchscope: {e}", file=sys.stderr)
        return 2
    print(f"batchscope: attaching to vLLM at {args.attach}..." if args.attach else "batchscope: loading the model...",
          file=sys.stderr, flush=True)
    try:
        service.start()                 # before listening: the URL is printed only once the model is ready
    except Exception as e:
        print(f"batchscope: {e}" if args.attach else f"batchscope: could not load the model: {e}", file=sys.stderr)
        return 1
    freeze_survivors()              # what was built so far lives as long as the server (engine/memory.py)
    cfg = service.config
    # no per-message deflate: compressing every record for every viewer costs more CPU (taken from the
    # engine) than the bandwidth it saves; records are small and viewers only send control messages.
    # No proxy headers: the app reads X-Forwarded-For itself, from the proxies it was told to trust
    # (app/serving/rate_limit.py), so it needs the peer's own address
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=args.log_level, proxy_headers=False,
                            ws_max_size=1 << 16, ws_per_message_deflate=False,
                            timeout_graceful_shutdown=int(cfg.shutdown_timeout_s))
    Server(config, service).run()
    service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
