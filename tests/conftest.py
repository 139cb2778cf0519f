import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Property tests search many cases; a busy CI machine must not turn a slow case into a failure.
from hypothesis import settings  # noqa: E402

settings.register_profile("batchscope", deadline=None)
settings.load_profile("batchscope")


# ---- a run in several workers (scripts/test.sh) ----
def pytest_configure(config):
    """In the controller of a parallel run on a fresh machine: prepare the default model at once, while
    the workers start and collect, instead of in the first worker that needs it while the others wait."""
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        return
    from engine.weights.loader import DEFAULT_MODEL_NAME, cache_dir, ready
    if not ready(cache_dir() / DEFAULT_MODEL_NAME):
        import subprocess
        import tempfile

        from tests.helpers import FRESH_PREPARE, fresh_prepare_command
        # the fresh-machine path itself: test_prepare checks this run's record instead of preparing again
        record = Path(tempfile.mkdtemp(prefix="batchscope-prepare-"))
        os.environ[FRESH_PREPARE] = str(record)          # the workers start after this hook
        config._batchscope_prepare = subprocess.Popen(     # the workers wait on its lock (engine/weights/loader.py)
            fresh_prepare_command(record), cwd=Path(__file__).resolve().parent.parent,
            stdout=(record / "stdout").open("w"), stderr=(record / "stderr").open("w"))


FREE_TO_START_GB = 3.0          # a test of a parallel run starts while this much memory is free ...
WAIT_FOR_MEMORY_S = 120         # ... or once it has waited this long


def available_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return None


def pytest_runtest_setup(item):
    """In a worker of a parallel run: wait for memory before a test starts. The workers' tests load models
    and start servers at moments nobody chooses; where several heavy ones meet on a small machine, the next
    one waits (at most WAIT_FOR_MEMORY_S) for the others to give memory back, instead of meeting the OOM
    killer. scripts/test.sh sizes the workers by the machine's memory; this is the margin for a machine whose
    tests need more than measured."""
    if not hasattr(item.config, "workerinput"):
        return
    import time
    deadline = time.monotonic() + WAIT_FOR_MEMORY_S
    while (free := available_gb()) is not None and free < FREE_TO_START_GB and time.monotonic() < deadline:
        time.sleep(0.5)


def pytest_collection_finish(session):
    """Once the tests are collected (torch, transformers, the browser driver and every test module
    imported): those objects move to the collector's permanent generation. They live as long as the
    process anyway; left where they were, every full collection walked them again, about a second
    each in a worker, among them the one after each test module below."""
    from engine.memory import freeze_survivors
    freeze_survivors()


def pytest_unconfigure(config):
    import gc
    gc.unfreeze()       # the interpreter's last collection sees everything again (nanobind counts leaks at exit)
    proc = getattr(config, "_batchscope_prepare", None)
    if proc is not None:
        proc.wait()
        import shutil

        from tests.helpers import FRESH_PREPARE
        shutil.rmtree(os.environ.pop(FRESH_PREPARE), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _screenshots_under_pytests_temp(tmp_path_factory):
    """The browser tests' screenshots (tests/browser.py screenshot_dir) go to pytest's own temporary
    folder of this run, which pytest removes after three newer runs; a folder of their own was left
    behind by every run. BATCHSCOPE_SCREENSHOT_DIR still chooses another place."""
    os.environ.setdefault("BATCHSCOPE_SCREENSHOT_DIR", str(tmp_path_factory.getbasetemp() / "screenshots"))


@pytest.fixture(scope="session")
def default_engine_fp32():
    from engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_gb=0.25))


@pytest.fixture(scope="session")
def hf_default_model():
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import default_model_folder
    return AutoModelForCausalLM.from_pretrained(default_model_folder(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def browser():
    """One Debian Chromium per browser-test module (tests/browser.py)."""
    from tests.browser import chromium
    with chromium() as b:
        yield b


# ---- a real server on loopback, shared by the server tests ----
PRESENTER_KEY = "test-presenter-key"


class LiveServer:
    """Where the test server listens, its in-process service, and small HTTP helpers (loopback only)."""

    def __init__(self, port: int, service):
        import httpx
        self.url = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/ws/steps"
        self.port, self.service, self.key = port, service, PRESENTER_KEY
        self.http = httpx.Client(base_url=self.url, timeout=120, trust_env=False)

    def chat(self, content: str = "Say hello.", **body):
        body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8, **body}
        return self.http.post("/v1/chat/completions", json=body)

    def engine(self) -> dict:
        return self.http.get("/api/engine").json()

    def set_engine(self, **changes):
        return self.http.post("/api/engine", json=changes, headers={"X-Presenter-Key": self.key})

    def records(self, last: int = 1024) -> list[dict]:
        return self.http.get("/api/trace", params={"last": last}).json()["records"]

    def openai(self, asynchronous: bool = False):
        import httpx
        import openai
        if asynchronous:
            return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="any", max_retries=0,
                                      http_client=httpx.AsyncClient(trust_env=False, timeout=120))
        return openai.OpenAI(base_url=self.url + "/v1", api_key="any", max_retries=0,
                             http_client=httpx.Client(trust_env=False, timeout=120))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama with the default tokenizer, saved once a session, for the tests whose subject
    is not the model's words. Its text is gibberish and it never ends a reply by itself: ask for max_tokens."""
    from tests.helpers import TINY_MODEL_NAME, save_tiny_model
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / TINY_MODEL_NAME)


@pytest.fixture(scope="session")
def live_server(tiny_model):
    """batchscope on the tiny random model, served by uvicorn on a free 127.0.0.1 port (see serve_on_loopback):
    the server, websocket, limits and fuzz tests."""
    from engine import EngineConfig
    yield from serve_on_loopback(EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_gb=0.25))


@pytest.fixture(scope="session")
def real_server():
    """The same server on the real default model: for the few end-to-end tests about what it says."""
    from engine import EngineConfig
    yield from serve_on_loopback(EngineConfig(kv_cache_gb=0.25))


def serve_on_loopback(engine_config):
    """batchscope served by uvicorn on a free 127.0.0.1 port, in a thread of this process (so tests can
    also reach its service), with small limits; stopped at the end of the session."""
    import socket
    import threading
    import time

    import uvicorn

    from app import EngineService, ServerConfig, create_app

    service = EngineService(engine_config,
                            ServerConfig(presenter_key=PRESENTER_KEY, max_tokens_cap=256, default_max_tokens=16,
                                         max_body_bytes=64 * 1024, max_ws_subscribers=8, ws_buffer=8,
                                         history=1024, snapshot_steps=50, health_recovery_s=3.0))
    sock = socket.socket()
    # small send buffers (accepted sockets inherit them) so that a viewer that stops reading fills
    # its pipe quickly, as a slow browser far away would, instead of after megabytes of loopback buffer
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
    sock.bind(("127.0.0.1", 0))
    # no keepalive pings: a test viewer that stops reading must not be dropped for a late pong
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", ws_max_size=1 << 16,
                                           ws_ping_interval=None, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    live = LiveServer(sock.getsockname()[1], service)
    try:
        yield live
    finally:
        live.http.close()
        service.begin_shutdown()
        server.should_exit = True
        thread.join(30)
        sock.close()


# ---- memory: what a module's fixtures held goes back to the system when the module ends ----
def resident_gb() -> float:
    from engine.memory import resident_bytes
    return resident_bytes() / 2**30


@pytest.fixture(scope="module", autouse=True)
def _free_after_module(request):
    """After each test module: engines in reference cycles collected, the rest frozen, and the heap trimmed.
    BATCHSCOPE_TEST_MEMLOG=FILE appends each module's resident memory after this (worker, module, GB)."""
    yield
    from engine.memory import freeze_survivors, release_free_heap
    # what survived is nearly all kept to the end (session fixtures, libraries a test imported late: gradio,
    # triton, sympy): frozen like the collection's imports (pytest_unconfigure unfreezes all)
    freeze_survivors()
    # The engine keeps freed memory in its heap on purpose (engine/execution/model_runner.py
    # keep_freed_memory) and each server's engine thread has an arena of its own, so in a worker that
    # starts engine after engine the free memory of finished ones would pile up (one once reached 15 GB)
    release_free_heap()
    log = os.environ.get("BATCHSCOPE_TEST_MEMLOG")
    if log:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(log, "a") as f:
            f.write(f"{worker} {request.module.__name__} {resident_gb():.2f}\n")
