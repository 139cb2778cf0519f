"""The soak test in its short form: a real server, concurrent openai clients, hang-ups, policy flips
and a small KV cache. It starts with a burst shaped to preempt (identical prompts admitted together
outgrow the cache), so every run sees at least one preemption; the random traffic after it may add more."""
import pytest

from demos.soak import main

pytestmark = [pytest.mark.soak, pytest.mark.server]


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["--requests", "30", "--clients", "12", "--kv-cache-gb", "0.006", "--max-tokens", "24",
                 "--flip-every", "1.5", "--json", str(out)]) == 0
