"""The soak test in its short form: a real server, concurrent openai clients, hang-ups, policy flips
and a small KV cache. It starts with a burst shaped to preempt (identical prompts admitted together
outgrow the cache), so every run sees at least one preemption; the random traffic after it may add more.
Its subject is the server, not the model's words: it runs on the tiny random model (greedy replies are
still checked against the same model run in-process), with a cache of eight blocks, as the default
model's 0.006 GB is."""
import pytest

from demos.load.soak import main

pytestmark = [pytest.mark.soak, pytest.mark.server]


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path, tiny_model):
    out = tmp_path / "soak.json"
    # the tiny model's fp32 block of 16 tokens is 8 KiB (2 layers, 2 KV heads of 16): eight blocks
    assert main(["--requests", "30", "--clients", "12", "--kv-cache-gb", str(8.5 * 8192 / 2**30), "--max-tokens", "24",
                 "--model", str(tiny_model), "--flip-every", "1.5", "--json", str(out)]) == 0
