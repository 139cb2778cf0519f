"""The browser reads record fields in one place (static/record.js), and only fields the schema has.

The schema is engine/outputs/records.py (record_fields()); the app adds `step_delay` to
policy events and to the settings in a snapshot (app/serving/service.py). A renamed or
misspelt field in record.js, an accessor used elsewhere that record.js lacks, or
a view reading a record field around record.js, fails here.
"""
import re
from pathlib import Path

from engine.outputs.records import record_fields

STATIC = Path(__file__).resolve().parent.parent / "static"
APP_FIELDS = {"policy": {"step_delay"}}         # added by the app, not the engine
# record.js names its parameters after what they hold: s step, it item, ev request event, p policy event,
# sc stall cause, op KV change, e KV map block
PARAM_TYPES = {"s": "step", "it": "item", "ev": "request", "p": "policy", "sc": "stall", "op": "kv_op", "e": "kv_block"}
READ = re.compile(r"\b(s|it|ev|p|sc|op|e)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")


def schema() -> dict[str, set[str]]:
    out = {k: set(v) for k, v in record_fields().items()}
    for k, extra in APP_FIELDS.items():
        out[k] |= extra
    return out


def fields_read(js: str) -> set[tuple[str, str]]:
    """(record type, field) for every read in record.js; s.kv.used reads kv's `used` too."""
    out = set()
    for var, name, sub in READ.findall(js):
        kind = PARAM_TYPES[var]
        out.add((kind, name))
        if kind == "step" and name in ("kv", "timing") and sub:
            out.add((name, sub))
    return out


def unknown_fields(js: str) -> list[tuple[str, str]]:
    known = schema()
    return sorted((kind, name) for kind, name in fields_read(js) if name not in known[kind])


def accessors(js: str) -> set[str]:
    """Names defined in record.js's `rec` object (`name: (x) =>` or `name(x) {`)."""
    return set(re.findall(r"^\s{2}(\w+)(?::\s*\(|\()", js, re.M))


# names that only records carry: a view that reads one of these has gone around record.js
RECORD_ONLY = re.compile(r"(?<!\bR)\.(t_start|t_end|token_budget|num_tokens|prompt_len|completes_prompt|finish_reason|"
                         r"output_tokens|items|kv|preempted|block_size|stall_causes|by_tokens|kv_ops|kv_map)\b")


STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')


def direct_reads(js: str) -> list[str]:
    """Lines (string literals aside) that read a record-only field other than through R."""
    return [line.strip() for line in js.splitlines() if RECORD_ONLY.search(STRINGS.sub('""', line))]


def test_every_field_record_js_reads_is_in_the_schema():
    js = (STATIC / "record.js").read_text()
    read = fields_read(js)
    assert len(read) > 25, "record.js should read the step, item, event and policy fields"
    assert unknown_fields(js) == []


def test_views_read_records_only_through_record_js():
    defined = accessors((STATIC / "record.js").read_text())
    for path in sorted(STATIC.glob("*.js")):
        if path.name == "record.js":
            continue
        js = path.read_text()
        assert direct_reads(js) == [], f"{path.name} reads record fields directly"
        used = set(re.findall(r"\bR\.(\w+)\(", js))
        assert used <= defined, f"{path.name} uses accessors record.js lacks: {sorted(used - defined)}"


def test_the_checks_catch_a_bad_read():
    assert unknown_fields("const f = (s) => s.t_ends;") == [("step", "t_ends")]
    assert unknown_fields("const f = (s) => s.kv.usd;") == [("kv", "usd")]
    assert unknown_fields("const f = (it) => it.prompt_len + it.tokens;") == []
    assert unknown_fields("const f = (p) => p.step_delay;") == []
    assert unknown_fields("const f = (sc) => sc.by + sc.caus;") == [("stall", "caus")]
    assert direct_reads("const x = rec.t_end - rec.t_start;\nconst y = tk.gap;") == \
        ["const x = rec.t_end - rec.t_start;"]
    assert direct_reads('const k = "metrics.kv", y = R.items(s);') == []
    assert accessors("export const rec = {\n  tEnd: (s) => s.t_end,\n  settings(p) {\n") == {"tEnd", "settings"}
