"""Record factories: StepRecords and request events built by hand, for tests whose answers are known
by construction (app/readers/metrics.py, app/readers/analysis.py, the page's twin of them). Field names as in
docs/step_record.md; only what the readers look at is filled in."""
from hypothesis import strategies as st


def step(i, t0, t1, items, budget=256, waiting=0, max_num_seqs=16, stalled=(), policy="chunked", **extra):
    return {"type": "step", "step": i, "t_start": t0, "t_end": t1, "policy": policy, "token_budget": budget,
            "max_num_seqs": max_num_seqs, "items": items, "num_tokens": sum(x["tokens"] for x in items),
            "finished": [], "preempted": [], "stalled": list(stalled), "waiting": waiting, "running": len(items),
            "kv": {"used": 4, "total": 64, "cached": 0, "block_size": 16}, **extra}


def dec(req, start=10, drafted=0, accepted=0):
    """A decode; with drafted > 0, one verifying that many drafts, of which `accepted` were kept."""
    item = {"req": req, "label": req.upper(), "kind": "decode", "tokens": 1 + drafted, "start": start}
    if drafted:
        item.update(drafted=drafted, accepted=accepted)
    return item


def pre(req, n, start, prompt_len, cached=None):
    item = {"req": req, "label": req.upper(), "kind": "prefill", "tokens": n, "start": start,
            "prompt_len": prompt_len, "completes_prompt": start + n == prompt_len}
    if cached:
        item["cached"] = cached
    return item


def cost_step(i, seconds, items, device="cpu/float32", **extra):
    return step(i, i * 10.0, i * 10.0 + seconds, items, device=device, **extra)


def linear_stream(a, b, c, shapes, device="cpu/float32"):
    """Steps whose time is exactly a + b*tokens + c*context: shapes = [(decode starts, (prefill start, n) | None)]."""
    out = []
    for i, (decodes, chunk) in enumerate(shapes):
        items = [dec(f"d{j}", start) for j, start in enumerate(decodes)]
        if chunk:
            items.append(pre("p", chunk[1], chunk[0], chunk[0] + chunk[1]))
        tokens = sum(it["tokens"] for it in items)
        context = sum(it["start"] + it["tokens"] for it in items)
        out.append(cost_step(i, a + b * tokens + c * context, items, device))
    return out


def arrived(req, t):
    return {"type": "request", "event": "arrived", "req": req, "label": req.upper(), "t": t}


def stall_stream(stall_s=1.0, tick=0.01):
    """a: arrives at 0, prefill in step 0, decodes steps 1-4; step 5 is b's whole prefill (a left out);
    a decodes again in steps 6-7. Each step lasts `tick` except step 5, which lasts `stall_s`."""
    s, t = [arrived("a", 0.0)], 0.0
    for i in range(8):
        dt = stall_s if i == 5 else tick
        if i == 0:
            items = [pre("a", 20, 0, 20)]
        elif i == 5:
            items = [pre("b", 500, 0, 500)]
        else:
            items = [dec("a")] + ([dec("b")] if i > 5 else [])
        s.append(step(i, t, t + dt, items, stalled=["a"] if i == 5 else []))
        t += dt
        if i == 4:
            s.append(arrived("b", t))
    return s


@st.composite
def random_streams(draw, speculative=False):
    """Engine-shaped streams: requests arrive, prefill in chunks (a first one sometimes after a cached
    prefix), decode or are left out (stalled), sometimes are preempted and recomputed; settings (policy,
    prefix caching, a KV cap, a chunk cap) change now and then. speculative: decodes verify 0 to k drafts and keep some,
    and k (the step's `speculative`, None: off) changes now and then too. Now and then the app's lesson
    message comes between two steps: no number may move for it."""
    n_req = draw(st.integers(1, 5))
    state = {f"r{i}": "new" for i in range(n_req)}
    s, t = [], 0.0
    for i in range(n_req):
        s.append(arrived(f"r{i}", 0.0))
    policy, k = "chunked", 3 if speculative else None
    caching, limit, chunk = True, None, None
    for i in range(draw(st.integers(1, 40))):
        if draw(st.booleans()) and draw(st.booleans()):
            policy = draw(st.sampled_from(["static", "continuous", "chunked"]))
        if speculative and draw(st.booleans()) and draw(st.booleans()):
            k = draw(st.sampled_from([None, 1, 3]))
        if draw(st.integers(0, 7)) == 0:
            caching, limit = draw(st.booleans()), draw(st.sampled_from([None, 8, 32]))
        if draw(st.integers(0, 9)) == 0:
            chunk = draw(st.sampled_from([None, 4, 16]))
        if draw(st.integers(0, 7)) == 0:
            s.append({"type": "lesson", "event": draw(st.sampled_from(["started", "ended", "stopped"])),
                      "lesson": draw(st.integers(1, 8)),
                      "text": draw(st.sampled_from(["step1", "step3", "speculative"]))})
        items, stalled, preempted = [], [], []
        for req, st_ in state.items():
            act = draw(st.sampled_from(["run", "run", "skip", "preempt"]))
            if st_ == "new" and act == "run":
                done, hit = draw(st.booleans()), draw(st.sampled_from([0, 0, 16])) if caching else 0
                items.append(pre(req, 4, hit, hit + (4 if done else 8), cached=hit))
                state[req] = "decoding" if done else "new"
            elif st_ == "decoding":
                if act == "run":
                    drafted = draw(st.integers(0, k)) if k else 0
                    items.append(dec(req, drafted=drafted, accepted=draw(st.integers(0, drafted))))
                elif act == "skip":
                    stalled.append(req)
                else:
                    preempted.append(req)
                    state[req] = "new"
        dt = draw(st.floats(0.001, 1.0))
        extra = {"speculative": k} if k else {}
        if not caching:
            extra["prefix_caching"] = False
        if chunk is not None:
            extra["max_prefill_chunk"] = chunk
        s.append(step(i, t, t + dt, items, stalled=stalled, preempted=preempted, policy=policy, **extra))
        if limit is not None:
            s[-1]["kv"] = {**s[-1]["kv"], "limit": limit}
        t += dt
    return s
