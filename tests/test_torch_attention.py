"""The torch backend's whole call (engine.execution.attention.TorchAttention) on random ragged batches against
attention computed sequence by sequence in fp64: decodes, fresh prefill chunks (runs of one length
share one call), chunks over a cached prefix; and how chunks are cut into runs."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.execution.attention import AttentionMetadata, PrefillChunk, TorchAttention, chunk_runs

BS, KV, HD, HEADS, NUM_BLOCKS = 4, 2, 8, 6, 96


def reference(q, k_cache, v_cache, seqs) -> torch.Tensor:
    """seqs: (first row, query tokens, context, block table). Causal at each query's position."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for start, n, ctx, table in seqs:
        keys = k_cache[table].flatten(0, 1)[:ctx].double().repeat_interleave(HEADS // KV, 1)   # (ctx, heads, hd)
        vals = v_cache[table].flatten(0, 1)[:ctx].double().repeat_interleave(HEADS // KV, 1)
        scores = torch.einsum("qhd,thd->hqt", q[start:start + n].double(), keys) / HD ** 0.5
        pos = torch.arange(ctx - n, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None] > pos, float("-inf"))
        out[start:start + n] = torch.einsum("hqt,thd->qhd", scores.softmax(-1), vals)
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_torch_backend_matches_attention_sequence_by_sequence(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, BS, KV, HD, generator=g),
                        torch.randn(NUM_BLOCKS, BS, KV, HD, generator=g))
    decodes = data.draw(st.lists(st.integers(1, 30), max_size=4))                 # context lengths
    chunk_len = data.draw(st.integers(1, 9))
    # prefill chunks: (tokens, cached before); runs of fresh chunks of one length are likely
    chunks = data.draw(st.lists(st.one_of(st.tuples(st.just(chunk_len), st.just(0)),
                                          st.tuples(st.integers(1, 9), st.integers(0, 12))), min_size=1, max_size=5))
    free = data.draw(st.permutations(range(NUM_BLOCKS)))
    seqs, slots, start, tables = [], [], 0, []
    for n, ctx in [(1, c) for c in decodes] + [(n, cached + n) for n, cached in chunks]:
        table = [free.pop() for _ in range(-(-ctx // BS))]
        seqs.append((start, n, ctx, table))
        slots += [table[p // BS] * BS + p % BS for p in range(ctx - n, ctx)]
        tables.append(table)
        start += n
    q = torch.randn(start, HEADS, HD, generator=g)
    k, v = torch.randn(start, KV, HD, generator=g), torch.randn(start, KV, HD, generator=g)
    width = max(map(len, tables))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), context_lens=torch.tensor([s[2] for s in seqs]),
                             block_tables=torch.tensor([t + t[:1] * (width - len(t)) for t in tables]),
                             num_decodes=len(decodes), decode_ctx=list(decodes))
    for first, n, ctx, table in seqs[len(decodes):]:
        mask = None if ctx == n else torch.arange(ctx)[None] <= torch.arange(ctx - n, ctx)[:, None]
        meta.prefills.append(PrefillChunk(first, n, ctx, torch.tensor(table), mask))
    out = TorchAttention()(q, k, v, k_cache, v_cache, meta)            # writes k, v into the cache first
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, seqs), rtol=1e-4, atol=1e-5)


def chunk(q_start: int, q_len: int, cached: int) -> PrefillChunk:
    mask = torch.ones(q_len, q_len + cached, dtype=torch.bool) if cached else None
    return PrefillChunk(q_start, q_len, q_len + cached, torch.zeros(1, dtype=torch.long), mask)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.sampled_from([0, 0, 3])), max_size=8))
def test_runs_are_fresh_chunks_of_one_length_side_by_side(shapes):
    chunks, start = [], 0
    for n, cached in shapes:
        chunks.append(chunk(start, n, cached))
        start += n
    runs = chunk_runs(chunks)
    assert [c for run in runs for c in run] == chunks                   # every chunk once, in order
    for run in runs:
        assert len(run) == 1 or all(c.mask is None and c.q_len == run[0].q_len for c in run)
    for a, b in zip(runs, runs[1:]):                                    # runs are as long as they can be
        x, y = a[-1], b[0]
        assert not (x.mask is None and y.mask is None and x.q_len == y.q_len)
