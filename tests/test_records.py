"""The record schema: one definition (engine/outputs/records.py), the docs generated from it, wire dicts that
readers may extend without touching the engine, and a scheduler that imports without torch."""
import subprocess
import sys
from pathlib import Path

import pytest

from engine.outputs.records import (
    KVState,
    PolicyEvent,
    RequestEvent,
    StepItem,
    StepRecord,
    record_fields,
    schema_markdown,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "step_record.md"


def test_docs_tables_are_the_schema():
    text = DOC.read_text()
    block = text.split("<!-- schema:start -->\n", 1)[1].split("<!-- schema:end -->", 1)[0]
    assert block == schema_markdown(), "docs/step_record.md is stale: paste `python -m engine.outputs.records` in"


def test_every_field_has_a_meaning_and_the_contract_names_are_kept():
    fields = record_fields()
    contract = {"step": {"type", "step", "t_start", "t_end", "policy", "token_budget", "max_num_seqs", "items",
                         "num_tokens", "finished", "preempted", "stalled", "kv", "waiting", "running", "timing"},
                "item": {"req", "label", "kind", "tokens", "start", "prompt_len", "completes_prompt", "cached"},
                "kv": {"used", "total", "cached", "block_size"},
                "request": {"type", "event", "req", "label", "t", "prompt_len", "max_tokens", "ttft",
                            "finish_reason", "output_tokens", "reason", "step"},
                "policy": {"type", "step", "t", "policy", "max_num_batched_tokens", "max_num_seqs",
                           "max_prefill_chunk"}}
    for kind, names in contract.items():
        assert names <= set(fields[kind]), f"{kind} lost {names - set(fields[kind])}"
    assert "| `` |" not in schema_markdown()


def step(**over):
    base = dict(step=3, t_start=1.0, t_end=1.5, policy="chunked", token_budget=8, max_num_seqs=2,
                items=(StepItem("r1", "A", "decode", 1, 9),), num_tokens=1, finished=(), preempted=(),
                stalled=(), stall_causes=(), kv=KVState(1, 8, 0, 4), waiting=0, running=1, failed=False)
    return StepRecord(**{**base, **over})


def test_wire_dicts_are_fresh_and_leave_out_absent_optionals():
    rec = step()
    a, b = rec.to_dict(), rec.to_dict()
    assert a == b and a is not b
    a["step_delay"] = 0.5                         # a reader's own field
    a["items"][0]["mine"] = True
    assert "step_delay" not in rec.to_dict() and "mine" not in rec.to_dict()["items"][0]
    assert set(a["items"][0]) == {"req", "label", "kind", "tokens", "start", "mine"}
    assert "error" not in a and a["failed"] is False and a["type"] == "step"
    assert step(failed=True, error="RuntimeError").to_dict()["error"] == "RuntimeError"
    # policy events keep max_prefill_chunk even when it is null: null means "no cap"
    assert PolicyEvent(1, 2.0, "chunked", 8, 2, None).to_dict()["max_prefill_chunk"] is None
    with pytest.raises(ValueError, match="request event"):
        RequestEvent("exploded", "r1", "A", 0.0)


def test_scheduler_imports_without_torch():
    code = ("import sys, engine.scheduling.scheduler, engine.outputs.records; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=DOC.parent.parent)
