"""`python -m app`: flags and environment, the printed URL, the presenter key, graceful shutdown."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.__main__ import parse_args
from app.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent


def test_flags_environment_and_defaults():
    d = parse_args([], env={})
    assert (d.host, d.port, d.policy, d.max_num_batched_tokens, d.max_num_seqs, d.step_delay, d.model) == \
        ("127.0.0.1", 7860, "chunked", 256, 64, 0.0, None)
    a = parse_args([], env={"BATCHSCOPE_MODEL": "some/model", "PORT": "8000", "BATCHSCOPE_STEP_DELAY": "0.5",
                            "BATCHSCOPE_POLICY": "static", "BATCHSCOPE_MAX_NUM_SEQS": "4", "HOST": "0.0.0.0"})
    assert (a.model, a.port, a.step_delay, a.policy, a.max_num_seqs, a.host) == \
        ("some/model", 8000, 0.5, "static", 4, "0.0.0.0")
    assert parse_args([], env={"PORT": "8000", "BATCHSCOPE_PORT": "8001"}).port == 8001
    assert parse_args(["--port", "9000"], env={"BATCHSCOPE_PORT": "8001"}).port == 9000
    for argv, env in [([], {"BATCHSCOPE_MAX_NUM_SEQS": "many"}), (["--policy", "fifo"], {}), (["--port", "x"], {})]:
        with pytest.raises(SystemExit):
            parse_args(argv, env=env)


def test_speculative_config_flag_takes_vllms_json(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert parse_args(["--speculative-config", spec], env={}).speculative_config == json.loads(spec)
    assert parse_args([], env={"BATCHSCOPE_SPECULATIVE_CONFIG": spec}).speculative_config["prompt_lookup_max"] == 4
    assert parse_args([], env={}).speculative_config is None
    for argv, env, words in [(["--speculative-config", spec[:-1]], {}, "not valid JSON"),
                             (["--speculative-config", spec.replace("prompt_lookup_max", "lookup")], {}, "'lookup'"),
                             (["--speculative-config", "[3]"], {}, "must be a dict"),
                             ([], {"BATCHSCOPE_SPECULATIVE_CONFIG": '{"method": "eagle"}'}, "'method'")]:
        with pytest.raises(SystemExit) as done:
            parse_args(argv, env=env)
        assert done.value.code == 2 and words in capsys.readouterr().err, (argv, env)


def test_the_pair_refuses_speculation_before_loading_anything():
    from engine import EngineConfig
    from engine.engines import EngineSwitch
    from engine.errors import SpeculationRefused
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    with pytest.raises(SpeculationRefused, match="disaggregated pair does not run speculative decoding"):
        EngineSwitch(EngineConfig(policy="disaggregated", speculative_config=spec))


def test_server_config_is_checked():
    assert ServerConfig(presenter_key="").presenter_key is None
    assert ServerConfig(max_tokens_cap=100).default_max_tokens == 100
    for bad in [dict(step_delay=-1), dict(step_delay=60), dict(max_waiting=0), dict(ws_buffer=10, history=5),
                dict(max_body_bytes="big"), dict(port=-1)]:
        with pytest.raises(ValueError):
            ServerConfig(**bad)


@pytest.mark.server
@pytest.mark.timeout(240)
def test_python_m_app_serves_then_shuts_down_gracefully():
    key = "s3cret-presenter-key"
    env = {**os.environ, "PRESENTER_KEY": key, "BATCHSCOPE_KV_CACHE_GB": "0.1", "BATCHSCOPE_MAX_TOKENS_CAP": "300"}
    proc = subprocess.Popen([sys.executable, "-m", "app", "--port", "0", "--policy", "continuous"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def pump():
        for line in proc.stdout:
            output.append(line)
            lines.put(line)
        lines.put("")                       # the process has ended
    threading.Thread(target=pump, daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 180
        while url is None:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line, "the server exited before serving:\n" + "".join(output)
            if m := re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", line):
                url = m.group(1)
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
            assert http.get("/healthz").json()["status"] == "ok"
            assert http.get("/api/engine").json()["policy"] == "continuous"
            denied = http.post("/api/engine", json={"policy": "chunked"})
            assert denied.status_code == 403 and key not in denied.text
            allowed = http.post("/api/engine", json={"policy": "chunked"}, headers={"X-Presenter-Key": key})
            assert allowed.status_code == 200 and allowed.json()["policy"] == "chunked"
            body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 300,
                    "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                events = r.iter_lines()
                for line in events:
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break
                proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                rest = [line for line in events if line.startswith("data: ")]
            assert time.monotonic() - t0 < 15, "the open stream held the shutdown up"
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "shutting down" in error["message"] and error["code"] == "service_unavailable"
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert key not in "".join(output)


def test_batchscope_command_dispatches_to_the_app_and_the_demos(capsys):
    from app.cli import main
    assert main([]) == 2 and "serve" in capsys.readouterr().out
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(c in listed for c in ("serve", "compare", "bench"))
    assert main(["serf"]) == 2 and "unknown command 'serf'" in capsys.readouterr().err
    for command, flag in [("serve", "--step-delay"), ("compare", "--scenario"), ("bench", "--batch")]:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0 and flag in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["serve", "--policy", "fifo"])
    assert done.value.code == 2 and "batchscope serve" in capsys.readouterr().err
