"""The page's metrics table, read out of a browser (TABLE_JS), and check(): every cell against what
app/readers/metrics.py gives for the same stream, formatted as the page formats it. Shared by the
page-vs-Python tests (tests/test_page_metrics.py) and the late-opened page (tests/test_browser_late.py)."""
import math
from decimal import ROUND_HALF_UP, Decimal

from app.readers import metrics

ROWS = ["steps", "ttft", "tbt", "stall", "tps", "kv", "waiting", "hit", "preempt"]
MAX_COLUMNS = 4         # the page shows the newest four stretches
# the metrics table's columns as the page shows them: per row, the text and the numbers behind it
TABLE_JS = """() => {
    const t = document.querySelector('[data-testid=metrics] table');
    return [...t.tHead.rows[0].querySelectorAll('th[data-policy]')].map((th, i) => {
        const col = {policy: th.dataset.policy};
        for (const tr of t.querySelectorAll('tr[data-metric]')) {
            const td = tr.cells[i + 1];
            col[tr.dataset.metric] = {text: td.textContent, values: JSON.parse(td.dataset.values)};
        }
        return col;
    });
}"""


def fixed(x: float, digits: int) -> str:
    """JavaScript's Number.toFixed: the exact binary value rounded half up (Python's format rounds half to even)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def sec(v):
    """The page's time format (static/metrics.js)."""
    return "–" if v is None else fixed(v * 1000, 0) + " ms" if v < 1 else fixed(v, 2) + " s"


def size(n: int) -> str:
    """The page's byte format (static/draw.js BS.fmtBytes)."""
    return fixed(n / 1e6, 1) + " MB" if n >= 1e6 else fixed(n / 1e3, 0) + " kB" if n >= 1e3 else f"{n} B"


def expected(m: dict) -> dict:
    """app.readers.metrics.stretches() output as the page's rows: (numbers, text)."""
    rows = {
        "steps": ([m["first_step"], m["last_step"], m["num_steps"]],
                  f"{m['first_step']}–{m['last_step']} ({m['num_steps']})"),
        "ttft": ([m["ttft_p50_s"], m["ttft_p99_s"]], f"{sec(m['ttft_p50_s'])} / {sec(m['ttft_p99_s'])}"),
        "tbt": ([m["tbt_p50_s"], m["tbt_p99_s"]], f"{sec(m['tbt_p50_s'])} / {sec(m['tbt_p99_s'])}"),
        "stall": ([m["stall_max_s"]], sec(m["stall_max_s"]) if m["stall_max_s"] > 0 else "0"),
        "tps": ([m["output_tokens_per_s"]],
                "–" if m["output_tokens_per_s"] is None else fixed(m["output_tokens_per_s"], 1)),
        "kv": ([m["kv_used_max"]], fixed(m["kv_used_max"] * 100, 1) + " %"),
        "waiting": ([m["waiting_max"]], str(m["waiting_max"])),
        "hit": ([m["prefix_hit_rate"]], "–" if m["prefix_hit_rate"] is None else fixed(m["prefix_hit_rate"] * 100, 1)
                + " %"),
        "preempt": ([m["preemptions"]], str(m["preemptions"])),
        "transfer": ([m["transfers"], m["transfer_p50_s"], m["transfer_p99_s"], m["transfer_bytes"]],
                     f"{m['transfers']} · {sec(m['transfer_p50_s'])} / {sec(m['transfer_p99_s'])} · "
                     f"{size(m['transfer_bytes'])}" if m["transfers"] else "–"),
        "spec": ([m["acceptance_rate"], m["accepted_tokens"], m["draft_tokens"]],
                 f"{fixed(m['acceptance_rate'] * 100, 1)} % ({m['accepted_tokens']} / {m['draft_tokens']})"
                 if m["draft_tokens"] else "–"),
    }
    return rows


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-12,
                                                                                          abs_tol=1e-12))


def check(page_cols: list[dict], stream: list[dict]):
    want = metrics.stretches(stream)[-MAX_COLUMNS:]
    assert [c["policy"] for c in page_cols] == [m["policy"] for m in want]
    shown = {"hit": any(m["prefix_hit_rate"] for m in want),      # a prompt served from the cache
             "preempt": any(m["preemptions"] for m in want),       # a preemption
             "transfer": any(m["transfers"] for m in want),        # a KV hand-over
             "spec": any(m["draft_tokens"] for m in want)}         # a verified draft: only then their lines show
    for col, m in zip(page_cols, want):
        assert all((row in col) == on for row, on in shown.items()), (m["policy"], shown, sorted(col))
        for row, (values, text) in expected(m).items():
            if not shown.get(row, True):
                continue
            got = col[row]
            assert len(got["values"]) == len(values) and all(map(same, got["values"], values)), (m["policy"], row,
                                                                                                 got, values)
            assert got["text"] == text, (m["policy"], row, got["text"], text)
