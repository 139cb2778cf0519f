"""Random calls of every CPU op (engine/kernels/ops.py), for tests/test_kernel_ops.py, which runs them
in a child process (a crash fails the test instead of ending pytest), once with the AddressSanitizer build:

    python -m tests.kernel_fuzz valid|invalid|valid,invalid [examples]

valid    random shapes (sizes that are not multiples of 16 or 32, odd head counts, strided rows, padded
         block tables): each op's result matches its torch reference (engine/kernels/reference.py)
invalid  one argument broken at a time (slots and block ids past the cache, context lengths past the table,
         heads % kv_heads, inter against the input width, cos/sin rows against the positions, packed weight
         shapes, dtypes, strides): each raises ValueError naming that argument, and nothing is written
"""
from __future__ import annotations

import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kernels import cpu_kernels as k
from engine.kernels import ops
from engine.kernels import reference as ref

FLOATS = [torch.float32, torch.bfloat16]


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def rows_view(data, g, rows: int, width: int, dtype, extra: int = 3) -> torch.Tensor:
    """(rows, width), sometimes a strided view of wider rows (as the model's slices of a fused projection)."""
    if data.draw(st.booleans(), label="strided"):
        return rand(g, rows, width + extra, dtype=dtype)[:, :width]
    return rand(g, rows, width, dtype=dtype)


def close(got, want, dtype):
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


# ---- one valid call per op: (kernel call, reference call, dtype) ----
def chains(data, g):
    dtype = data.draw(st.sampled_from(FLOATS))
    rows, hidden = data.draw(st.integers(0, 40)), data.draw(st.integers(1, 200))
    x, res, w = (rows_view(data, g, rows, hidden, dtype), rand(g, rows, hidden, dtype=dtype),
                 rand(g, hidden, dtype=dtype))
    close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), dtype)
    (n1, s1), (n2, s2) = ops.add_rms_norm(x, res, w, 1e-5), ref.add_rms_norm(x, res, w, 1e-5)
    close(n1, n2, dtype)
    assert torch.equal(s1, s2)
    inter = data.draw(st.integers(1, 200))
    gu = rows_view(data, g, rows, 2 * inter, dtype)
    close(ops.silu_and_mul(gu, inter), ref.silu_and_mul(gu, inter), dtype)
    heads, d = data.draw(st.integers(1, 7)), 2 * data.draw(st.integers(1, 65))
    qk = rand(g, rows, heads + data.draw(st.integers(0, 3)), d, dtype=dtype)[:, :heads]     # strided rows
    cos, sin = rand(g, rows, 1, d, dtype=dtype), rand(g, rows, 1, d, dtype=dtype)
    close(ops.rope(qk, cos, sin), ref.apply_rope(qk, cos, sin), dtype)


def paged(data, g, dtype=None):
    """A random cache, batch and tables: (q, k, v, k_cache, v_cache, slots, tables, lens)."""
    dtype = dtype or data.draw(st.sampled_from(FLOATS))
    bs, d = data.draw(st.sampled_from(sorted(k.SHAPES)))
    kvh = data.draw(st.integers(1, 3))
    heads, nb = kvh * data.draw(st.integers(1, 5)), data.draw(st.integers(4, 24))
    k_cache, v_cache = rand(g, nb, bs, kvh, d, dtype=dtype), rand(g, nb, bs, kvh, d, dtype=dtype)
    free = data.draw(st.permutations(range(nb)))
    n = data.draw(st.integers(1, 4))
    lens = [data.draw(st.integers(1, bs * (len(free) // n))) for _ in range(n)]
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in lens]
    width = max(map(len, tables)) + data.draw(st.integers(0, 2))     # rows padded with 0, as the runner pads
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([int(tables[i, (c - 1) // bs]) * bs + (c - 1) % bs for i, c in enumerate(lens)])
    qkv = rand(g, n, heads + 2 * kvh + data.draw(st.integers(0, 2)), d, dtype=dtype)
    q, key, val = qkv[:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:heads + 2 * kvh]
    return q, key, val, k_cache, v_cache, slots, tables, torch.tensor(lens)


def attention(data, g):
    q, key, val, kc, vc, slots, tables, lens = paged(data, g)
    kc2, vc2 = kc.clone(), vc.clone()
    ops.write_kv(key, val, kc, vc, slots)
    ref.write_kv(key, val, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    close(ops.paged_decode(q, kc, vc, tables, lens), ref.paged_decode(q, kc, vc, tables, lens), q.dtype)


def causal(data, g):
    if not k.avx512():
        return
    dtype, d = data.draw(st.sampled_from(FLOATS)), data.draw(st.sampled_from([64, 128]))
    m, q_len, kvh = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 70)), data.draw(st.integers(1, 3))
    heads = kvh * data.draw(st.integers(1, 3))
    qkv = rand(g, m * q_len, heads + 2 * kvh, d, dtype=dtype)
    q, key, val = qkv[:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]
    close(ops.causal_prefill_or_none(q, key, val, m), ref.causal_prefill(q, key, val, m), dtype)


def linears(data, g):
    rows, n, kk = data.draw(st.integers(0, 40)), 16 * data.draw(st.integers(1, 9)), data.draw(st.integers(1, 100))
    if k.f32_kernel():
        x, w = rows_view(data, g, rows, kk, torch.float32), rand(g, n, kk)
        b = rand(g, n) if data.draw(st.booleans()) else None
        close(ops.linear_f32(x, ops.pack_f32(w), n, b), ref.linear(x, w, b), torch.float32)
    if k.amx_bf16():
        kk = 32 * data.draw(st.integers(1, 6))
        x, w = rand(g, rows, kk, dtype=torch.bfloat16), rand(g, n, kk, dtype=torch.bfloat16)
        assert torch.equal(ops.linear_amx(x, ops.pack_amx(w), n), ref.linear_tiles(x, w))


def layer_stack(data, g, dtype):
    """A small random Llama-shaped stack: (x, cos, sin, meta, packed weights, plain weights, heads, kv_heads)."""
    from engine.execution.attention import AttentionMetadata
    q, _, _, kc, vc, slots, tables, lens = paged(data, g, dtype)
    n, heads, d = q.shape
    kvh = kc.shape[2]
    hidden, inter = 32 * data.draw(st.integers(1, 4)), 32 * data.draw(st.integers(1, 4))
    layers = data.draw(st.integers(1, 3))
    shapes = {"qkv": ((heads + 2 * kvh) * d, hidden), "o": (hidden, heads * d), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter)}
    plain = {name: [rand(g, *s, dtype=dtype) / s[1] ** 0.5 for _ in range(layers)] for name, s in shapes.items()}
    plain |= {"input_norm": [rand(g, hidden, dtype=dtype) for _ in range(layers)],
              "post_norm": [rand(g, hidden, dtype=dtype) for _ in range(layers)],
              "k_cache": [kc.clone() for _ in range(layers)], "v_cache": [vc.clone() for _ in range(layers)]}
    pack = ops.pack_amx if dtype == torch.bfloat16 else ops.pack_f32
    packed = {name: [pack(w) if name in shapes else w.clone() for w in ws] for name, ws in plain.items()}
    meta = AttentionMetadata(slot_mapping=slots, context_lens=lens, block_tables=tables, num_decodes=n)
    # a rotary table as the model's (engine/models/llama.py: cos twice, sin with its first half negated), not
    # random values: cos and sin above 1 would multiply the keys' last-bit differences (a linear summing in
    # another order) into differences larger than bf16's tolerance where the two products nearly cancel
    angle = rand(g, n, 1, d // 2) * 10
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(dtype)
    return rand(g, n, hidden, dtype=dtype), cos, sin, meta, packed, plain, heads, kvh


def layers(data, g):
    dtype = torch.float32 if k.f32_kernel() else None
    dtype = torch.bfloat16 if k.amx_bf16() and data.draw(st.booleans()) else dtype
    if dtype is None:
        return
    x, cos, sin, meta, packed, plain, heads, kvh = layer_stack(data, g, dtype)
    want_x, want_res = ref.decode_layers(x.clone(), cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
                                         plain, heads, kvh, 1e-5)
    res = ops.decode_step(x, cos, sin, meta, packed, heads=heads, kv_heads=kvh, eps=1e-5)
    close(res, want_res, dtype)
    close(x, want_x, dtype)
    for a, b in zip(packed["k_cache"] + packed["v_cache"], plain["k_cache"] + plain["v_cache"]):
        close(a, b, dtype)


VALID = {"chains": chains, "attention": attention, "causal_prefill": causal, "linears": linears,
         "decode_layers": layers}


def fuzz_valid(examples: int):
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.data(), st.sampled_from(sorted(VALID)), st.integers(0, 2**16))
    def run(data, name, seed):
        VALID[name](data, torch.Generator().manual_seed(seed))
    run()


# ---- one argument broken at a time: (the call, the argument its error must name) ----
def broken(data, g):
    """A valid call of one op with one argument broken; yields (call, name the ValueError must hold)."""
    q, key, val, kc, vc, slots, tables, lens = paged(data, g, torch.float32)
    nb, bs = kc.shape[0], kc.shape[1]
    far = data.draw(st.sampled_from([nb * bs, nb * bs + 1, 10**9, -1]))
    x, w = rand(g, 3, 40), rand(g, 40)
    cases = {
        "slot past the cache": (lambda: ops.write_kv(key, val, kc, vc, slots.index_fill(0, torch.tensor([0]), far)),
                                "slot_mapping"),
        "slots of other tokens": (lambda: ops.write_kv(key, val, kc, vc, torch.cat([slots, slots])), "slot_mapping"),
        "block id past the cache": (lambda: ops.paged_decode(q, kc, vc, tables.index_fill(
            1, torch.tensor([0]), nb + data.draw(st.integers(0, 5))), lens), "block_tables"),
        "negative block id": (lambda: ops.paged_decode(q, kc, vc, tables.index_fill(1, torch.tensor([0]), -1), lens),
                              "block_tables"),
        "context past the table": (lambda: ops.paged_decode(q, kc, vc, tables, lens + tables.shape[1] * bs),
                                   "context_lens"),
        "empty context": (lambda: ops.paged_decode(q, kc, vc, tables, lens * 0), "context_lens"),
        "short table": (lambda: ops.paged_decode(q, kc, vc, tables[:0], lens), "block_tables"),
        # one KV head divides every head count: then a cache of two (causal_prefill has a kernel only
        # with AVX-512, and without one it hands the call to SDPA, so decode's op is the one checked)
        "heads % kv_heads": (lambda: ops.paged_decode(rand(g, q.shape[0], 3, kc.shape[3]), kc.repeat(1, 1, 2, 1),
                                                      vc.repeat(1, 1, 2, 1), tables, lens)
                             if kc.shape[2] == 1 else
                             ops.paged_decode(rand(g, q.shape[0], kc.shape[2] + 1, kc.shape[3]), kc, vc, tables, lens),
                             "kv_heads"),
        "strided cache": (lambda: ops.write_kv(key, val, kc.transpose(0, 1).contiguous().transpose(0, 1), vc, slots),
                          "k_cache"),
        "cache of another dtype": (lambda: ops.write_kv(key, val, kc.double(), vc, slots), "k_cache"),
        "inter against the width": (lambda: ops.silu_and_mul(rand(g, 3, 64), data.draw(st.sampled_from([31, 33, 0]))),
                                    "inter"),
        "cos rows against positions": (lambda: ops.rope(rand(g, 3, 2, 64), rand(g, 2, 1, 64), rand(g, 3, 1, 64)),
                                       "cos"),
        "sin rows against positions": (lambda: ops.rope(rand(g, 3, 2, 64), rand(g, 3, 1, 64), rand(g, 4, 1, 64)),
                                       "sin"),
        "norm weight width": (lambda: ops.rms_norm(x, rand(g, 41), 1e-5), "weight"),
        "residual shape": (lambda: ops.add_rms_norm(x, rand(g, 2, 40), w, 1e-5), "residual"),
        "pack outputs not a multiple of 16": (lambda: ops.pack_f32(rand(g, 24, 40)), "w"),
        "tile layout input not a multiple of 32": (lambda: ops.pack_amx(rand(g, 32, 48, dtype=torch.bfloat16)), "w"),
    }
    if k.avx512():
        cases["chunks that do not split the rows"] = (lambda: torch.ops.batchscope.causal_prefill(
            rand(g, 5, 2, 64), rand(g, 5, 2, 64), rand(g, 5, 2, 64), 2), "m")
    if k.f32_kernel():
        packed = ops.pack_f32(rand(g, 32, 40))
        cases |= {
            "packed weight against x": (lambda: ops.linear_f32(rand(g, 3, 41), packed, 32), "x"),
            "out_features against the packed weight": (lambda: ops.linear_f32(x, packed, 48), "out_features"),
            "packed outputs not a multiple of 16": (lambda: ops.linear_f32(x, rand(g, 24, 40), 24), "packed"),
            "bias length": (lambda: ops.linear_f32(x, packed, 32, rand(g, 31)), "b"),
        }
        x2, cos, sin, meta, packed_w, _, heads, kvh = layer_stack(data, g, torch.float32)
        stack_slots = packed_w["k_cache"][0].shape[0] * packed_w["k_cache"][0].shape[1]
        meta_bad = type(meta)(slot_mapping=meta.slot_mapping + stack_slots, context_lens=meta.context_lens,
                              block_tables=meta.block_tables)
        hidden, inter = x2.shape[1], packed_w["down"][0].shape[1]
        short = {**packed_w, "down": [ops.pack_f32(rand(g, hidden, inter + 32)) for _ in packed_w["down"]]}
        cases |= {
            "decode_layers slot": (lambda: ops.decode_step(x2, cos, sin, meta_bad, packed_w, heads=heads,
                                                           kv_heads=kvh, eps=1e-5), "slot_mapping"),
            "decode_layers inter": (lambda: ops.decode_step(x2, cos, sin, meta, short, heads=heads, kv_heads=kvh,
                                                            eps=1e-5), "down[0]"),
            "decode_layers kv_heads": (lambda: ops.decode_step(x2, cos, sin, meta, packed_w, heads=heads,
                                                               kv_heads=kvh + 1, eps=1e-5), "kv_heads"),
            "decode_layers cos rows": (lambda: ops.decode_step(x2, cos[:-1], sin, meta, packed_w, heads=heads,
                                                               kv_heads=kvh, eps=1e-5), "cos"),
        }
    name = data.draw(st.sampled_from(sorted(cases)), label="broken")
    return cases[name], (kc, vc)


def fuzz_invalid(examples: int):
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.data(), st.integers(0, 2**16))
    def run(data, seed):
        (call, argument), caches = broken(data, torch.Generator().manual_seed(seed))
        before = [c.clone() for c in caches]
        try:
            call()
        except ValueError as e:
            assert argument in str(e), f"the error names another argument than {argument}: {e}"
        else:
            raise AssertionError(f"a call with a broken {argument} did not raise")
        assert all(torch.equal(a, b) for a, b in zip(before, caches)), "a refused call wrote into the cache"
    run()


if __name__ == "__main__":
    if k.library() is None:
        sys.exit("the CPU kernels did not load")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    for kind in sys.argv[1].split(","):        # "valid,invalid": both, in one process
        {"valid": fuzz_valid, "invalid": fuzz_invalid}[kind](n)
    print("ok", flush=True)
