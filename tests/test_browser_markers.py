"""The chart's setting flags name what changed. A stretch of steps runs under one setting (policy, token
budget, max sequences, the chunk cap, speculative decoding, prefix caching, KV cap: static/record.js
settingKey) and a flag marks where a new one starts; each flag says, in the words of the metrics table's
column heads, every part of the setting that changed there, so no flag is an empty black box. The chart's
text (its table and the live region's sentence for a step) says the same words at the same step."""
from contextlib import closing

from tests.browser import MARKS, load_stage
from tests.factories import arrived, dec, step

pytestmark = MARKS

# (changes from the setting before, the words its flag must hold): one stretch of steps each
KV = {"used": 4, "total": 64, "cached": 0, "block_size": 16}
STRETCHES = [
    ({}, None),                                                   # the first setting: no flag
    ({"budget": 128}, ["budget 128"]),
    ({"max_num_seqs": 3}, ["max seqs 3"]),
    ({"speculative": 3}, ["drafts ≤ 3"]),
    ({"speculative": None}, ["no speculation"]),
    ({"prefix_caching": False}, ["prefix caching off"]),
    ({"prefix_caching": None}, ["prefix caching on"]),
    ({"kv": {**KV, "limit": 24}}, ["KV cap 24"]),
    ({"kv": KV}, ["the whole KV cache"]),
    ({"max_prefill_chunk": 4}, ["chunks ≤ 4"]),
    ({"max_prefill_chunk": None}, ["no chunk cap"]),
    ({"policy": "continuous", "budget": 256, "speculative": 2}, ["chunked prefill OFF → continuous", "budget 256",
                                                                  "drafts ≤ 2"]),
    ({"policy": "chunked", "max_num_seqs": 16, "kv": {**KV, "limit": 8}}, ["chunked prefill ON", "max seqs 16",
                                                                            "KV cap 8"]),
]


def stream() -> list[dict]:
    out, setting, i = [arrived("a", 0.0)], {"budget": 256, "max_num_seqs": 16, "policy": "chunked"}, 0
    for change, _ in STRETCHES:
        setting = {**setting, **change}
        for _ in range(4):
            extra = {k: v for k, v in setting.items() if v is not None}
            out.append(step(i, 0.1 * i, 0.1 * i + 0.09, [dec("a", 10 + i)], **extra))
            i += 1
    return out


def test_every_setting_flag_names_each_part_that_changed(browser):
    page = browser.new_page(viewport={"width": 1920, "height": 1080})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with closing(page):
        load_stage(page, stream())
        page.wait_for_function(f"BS.view.drawn && BS.view.drawn.markers.length === {len(STRETCHES) - 1}")
        flags = page.evaluate("BS.view.drawn.markers.map(m => [m.step, m.text])")
        assert [s for s, _ in flags] == [4 * k for k in range(1, len(STRETCHES))]
        for (_, text), (change, words) in zip(flags, STRETCHES[1:]):
            assert text == ", ".join(words), f"{change}: the flag says {text!r}"
        assert not errors, errors


def test_the_charts_text_says_the_same_change_at_the_same_step(browser):
    page = browser.new_page(viewport={"width": 1366, "height": 900})
    with closing(page):
        records = stream()
        load_stage(page, records)
        page.wait_for_function(f"BS.view.drawn && BS.view.drawn.markers.length === {len(STRETCHES) - 1}")
        steps = [r for r in records if r["type"] == "step"]
        said = page.evaluate("(s) => s.map(BS.describeStep)", steps)
        for k, (_, words) in enumerate(STRETCHES):
            if words:
                assert said[4 * k] == f"step {4 * k}: new setting, {', '.join(words)}; 1 reply", said[4 * k]
            assert said[4 * k + 1] == f"step {4 * k + 1}: 1 reply"
        page.click("[data-testid=table-toggle]")
        heads = page.evaluate("[...document.querySelectorAll('[data-testid=chart-table] tbody th')]"
                              ".map(c => c.textContent)")
        assert len(heads) == 12                  # the last twelve steps: the last stretch's flag among them
        last = 4 * (len(STRETCHES) - 1)
        assert heads[-4] == f"{last} (new setting, {', '.join(STRETCHES[-1][1])})", heads
        assert heads[-3] == str(last + 1)
