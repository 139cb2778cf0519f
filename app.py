"""Hugging Face Spaces entry point: the whole app (UI, API, step stream) on the port Spaces exposes.

CPU hardware serves the embedded default model (SmolLM2-135M-Instruct). On GPU
hardware, choose a bigger model with the Space variable BATCHSCOPE_MODEL, for
example Qwen/Qwen2.5-1.5B-Instruct. Every flag of `python -m app --help` can be
set the same way (BATCHSCOPE_STEP_DELAY, BATCHSCOPE_MAX_NUM_BATCHED_TOKENS, ...);
set PRESENTER_KEY as a Space secret to lock the engine controls.

Every connection to a Space comes through its proxy, so the X-Forwarded-For it
sets is believed from any peer (`--forwarded-allow-ips '*'`) unless
FORWARDED_ALLOW_IPS or BATCHSCOPE_FORWARDED_ALLOW_IPS says otherwise.
"""
import os
import sys

from app.__main__ import main

if __name__ == "__main__":
    host = os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0")     # Spaces sets these two
    port = os.environ.get("GRADIO_SERVER_PORT", "7860")
    proxies = [] if {"FORWARDED_ALLOW_IPS", "BATCHSCOPE_FORWARDED_ALLOW_IPS"} & set(os.environ) else \
        ["--forwarded-allow-ips", "*"]
    sys.exit(main(["--host", host, "--port", port, *proxies]))
