"""The soak test in its short form: a real server, concurrent openai clients, hang-ups, policy flips
and a cache small enough to force preemption. The long form is `python -m demos.soak`."""
import pytest

from demos.soak import main

pytestmark = [pytest.mark.soak, pytest.mark.server]


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["--requests", "24", "--clients", "8", "--flip-every", "1.5", "--json", str(out)]) == 0
