"""The soak test in its short form: a real server, concurrent openai clients, hang-ups, policy flips
and a small KV cache. In 30 requests that share prompts through the prefix cache a preemption is
likely but not certain, so this form does not require one; the long form (`python -m demos.soak`,
27 preemptions in docs/reliability.md) does, and tests/test_invariants.py forces them."""
import pytest

from demos.soak import main

pytestmark = [pytest.mark.soak, pytest.mark.server]


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["--requests", "30", "--clients", "12", "--kv-cache-gb", "0.006", "--max-tokens", "24", "--flip-every", "1.5", "--allow-no-preemption", "--json", str(out)]) == 0
