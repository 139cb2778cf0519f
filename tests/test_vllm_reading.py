"""The vLLM recorder's pure parts, without vLLM: how a step is read (integrations/vllm/reading.py)
and how records leave the engine (publisher.py). The scheduler itself: tests/test_vllm_recorder.py."""
from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace as NS

from integrations.vllm import reading
from integrations.vllm.publisher import QUEUE_RECORDS, Publisher


def req(rid, prompt, reply, computed, placeholders=0, chunk=False):
    return NS(request_id=rid, num_prompt_tokens=prompt, num_output_tokens=reply, num_tokens=prompt + reply,
              num_computed_tokens=computed, num_output_placeholders=placeholders, is_prefill_chunk=chunk)


def output(scheduled: dict, new=(), resumed=(), preempted=(), finished=()):
    return NS(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
              scheduled_new_reqs=[NS(req_id=r) for r in new],
              scheduled_cached_reqs=NS(resumed_req_ids=set(resumed)), preempted_req_ids=set(preempted),
              finished_req_ids=set(finished))


def test_decodes_chunks_and_cache_hits_are_told_apart():
    # after schedule(): a decode (its last token), a middle chunk, a new prompt whose first 32 tokens hit the cache
    reqs = {"a": req("a", 10, 5, 15), "doc": req("doc", 300, 0, 96, chunk=True), "n": req("n", 40, 0, 40)}
    before = reading.read_before([reqs["a"], reqs["doc"]])
    out = output({"doc": 32, "a": 1, "n": 8}, new=["n"])
    items = reading.read_items(out, reqs, before, {})
    assert [(i.req, i.kind, i.tokens, i.start) for i in items] == [("a", "decode", 1, 14), ("doc", "prefill", 32, 64),
                                                                    ("n", "prefill", 8, 32)]
    assert items[1].completes_prompt is False and items[1].cached is None
    assert items[2].completes_prompt is True and items[2].cached == 32 and items[2].prompt_len == 40


def test_a_resumed_reply_is_a_recompute_and_its_first_chunk_of_a_new_prompt_is_not_a_decode():
    reqs = {"r": req("r", 20, 6, 16), "one": req("one", 1, 0, 1, placeholders=1)}   # async: a placeholder already
    out = output({"r": 16, "one": 1}, new=["one"], resumed=["r"])
    items = {i.req: i for i in reading.read_items(out, reqs, {}, {})}
    assert items["r"].kind == "prefill" and items["r"].prompt_len == 26 and items["r"].completes_prompt is False
    assert items["one"].kind == "prefill" and items["one"].completes_prompt is True


def test_replies_left_out_are_stalls_with_the_cause_the_step_shows():
    running = [req("doc", 300, 0, 64, chunk=True), req("a", 10, 3, 12), req("b", 10, 3, 12),
               req("p", 50, 0, 50, chunk=True)]
    before = reading.read_before(running)
    assert before == {"doc": False, "a": True, "b": True, "p": False}
    spent = output({"doc": 32})                                   # the budget of 32 went to the chunk
    assert reading.read_stalls(spent, before, 32)[0] == ("a", "b")
    assert {c.cause for c in reading.read_stalls(spent, before, 32)[1]} == {"budget"}
    full = output({"doc": 8, "a": 1}, preempted=["b"])           # b preempted, nothing else fit: KV full
    assert reading.read_stalls(full, before, 32)[0] == ()
    full2 = output({"doc": 8}, preempted=["p"])
    stalled, causes = reading.read_stalls(full2, before, 32)
    assert stalled == ("a", "b") and {c.cause for c in causes} == {"kv_full"}
    neither = output({"doc": 8})                                  # a rule the recorder does not model: no stall
    assert reading.read_stalls(neither, before, 32) == ((), ())


def test_kv_counts_leave_out_the_null_block():
    pool = NS(num_gpu_blocks=101, get_num_free_blocks=lambda: 60, cached_block_hash_to_block={1: 0, 2: 0})
    kv = reading.read_kv(pool, 16)
    assert (kv.used, kv.total, kv.cached, kv.block_size) == (40, 100, 2, 16)


def test_the_publisher_sends_hello_then_lines_and_drops_instead_of_blocking():
    pub = Publisher("127.0.0.1", 0, {"type": "hello", "engine": "vllm test"})
    try:
        conn = socket.create_connection(("127.0.0.1", pub.port), timeout=5)
        f = conn.makefile("r")
        assert json.loads(f.readline())["engine"] == "vllm test"
        deadline = time.monotonic() + 5
        while pub.num_readers == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        pub.publish({"type": "step", "step": 0})
        assert json.loads(f.readline()) == {"type": "step", "step": 0}
        t = time.perf_counter()
        for i in range(QUEUE_RECORDS * 3):        # far more than the queue holds, at once
            pub.publish({"type": "step", "step": i + 1, "pad": "x" * 200})
        assert time.perf_counter() - t < 2.0, "publishing never waits for the reader"
        assert pub.dropped > 0
        time.sleep(0.5)                            # the sender catches up; then one more record
        pub.publish({"type": "end"})
        seen, gap = 0, 0
        while (obj := json.loads(f.readline()))["type"] != "end":
            seen += obj["type"] == "step"
            gap += obj.get("dropped", 0)
        assert seen + gap == QUEUE_RECORDS * 3 and gap == pub.dropped, "each drop is told by a gap line"
    finally:
        pub.close()


def test_a_taken_port_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        try:
            Publisher("127.0.0.1", port, {})
        except OSError as e:
            assert f"127.0.0.1:{port}" in str(e) and "BATCHSCOPE_RECORDS_PORT" in str(e)
        else:
            raise AssertionError("a second listener on a taken port must fail")
