"""The colour arithmetic the accessibility checks rest on (tests/colour_vision.py), and the palette's
promise in numbers: neighbouring users' colours stay apart for deuteranopes and protanopes."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.ui.text import USERS
from tests.colour_vision import CVD, ciede2000, ciede2000_lab, contrast, hex_rgb, simulate

NEIGHBOURS_APART = 10        # CIEDE2000 between the colours of neighbouring rows, under each deficiency
rgb = st.tuples(*[st.integers(0, 255)] * 3)


@pytest.mark.parametrize("lab1, lab2, expected", [            # Sharma, Wu and Dalal (2005), table 1
    ((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425),
    ((50, 0, 0), (50, -1, 2), 2.3669),
    ((50, 2.5, 0), (73, 25, -18), 27.1492),
    ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644),
    ((22.7233, 20.0904, -46.6940), (23.0331, 14.9730, -42.5619), 2.0373),
])
def test_ciede2000_matches_the_published_pairs(lab1, lab2, expected):
    assert ciede2000_lab(lab1, lab2) == pytest.approx(expected, abs=1e-4)


@given(rgb, rgb)
def test_differences_and_contrasts_are_symmetric_and_zero_only_on_equal_colours(a, b):
    assert ciede2000(a, b) == pytest.approx(ciede2000(b, a), abs=1e-9)
    assert contrast(a, b) == pytest.approx(contrast(b, a)) and 1 <= contrast(a, b) <= 21
    assert ciede2000(a, a) == pytest.approx(0, abs=1e-6)
    if a != b:
        assert ciede2000(a, b) > 0


def test_wcag_contrast_of_known_pairs():
    assert contrast((0, 0, 0), (255, 255, 255)) == pytest.approx(21)
    assert contrast(hex_rgb("#767676"), hex_rgb("#FFFFFF")) == pytest.approx(4.54, abs=0.01)


@given(rgb)
def test_a_grey_looks_the_same_to_everyone(v):
    grey = (v[0],) * 3
    for kind in CVD:
        assert ciede2000(grey, simulate(grey, kind)) < 1.0, kind


@pytest.mark.parametrize("kind", sorted(CVD))
def test_neighbouring_users_stay_apart_under_colour_vision_deficiency(kind):
    """Users take rows in slot order (app/serving/room.py), so neighbours are consecutive palette entries,
    and the ninth user comes back to the first colour beside the eighth."""
    seen = [simulate(hex_rgb(c), kind) for _, c in USERS]
    for i, (name, _) in enumerate(USERS):
        j = (i + 1) % len(USERS)
        d = ciede2000(seen[i], seen[j])
        assert d >= NEIGHBOURS_APART, f"{kind}: {name} and {USERS[j][0]} only {d:.1f} apart"
