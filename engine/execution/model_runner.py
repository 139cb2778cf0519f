"""The model runner: a Batch of (sequence, num_tokens) in, one forward pass, next tokens out.

It holds the model (engine.weights.loader loads it), the paged KV cache and the RoPE
table, flattens the step's
tokens into one ragged batch (decodes first, then prefill chunks) as plain
lists, moves them to the device in one copy, builds the step's
AttentionMetadata, runs the model once (on CUDA with the Triton backend, every
step up to the token budget replays a CUDA graph at a padded token bucket:
engine/execution/cuda_graph.py) and samples.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.execution.attention import AttentionMetadata, PrefillChunk, set_metadata
from engine.execution.backends import select_backend
from engine.execution.cuda_graph import StepGraphs
from engine.execution.sampler import sample, sample_runs
from engine.models.llama import head_dim_of, rope_table
from engine.sampling_params import SamplingParams
from engine.scheduling.scheduler import Batch
from engine.scheduling.sequence import Sequence
from engine.weights.loader import load_model


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # numpy's calloc hands back lazily zeroed pages: a 1 GB cache costs nothing until it is used
    import numpy as np
    raw = np.zeros(int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def keep_freed_memory():
    """CPU, glibc: keep freed memory in the heap for the next op instead of handing it back to the system.
    By default glibc gives each freed block above a threshold (128 KB at first) back at once, and trims
    the heap's top when 128 KB of it are free; a step's activations (several MB each at a 2048-token
    step) then come back as fresh pages, faulted in and zeroed on first touch, op after op. Serving
    engines on CPU preload tcmalloc or jemalloc for this; raising the two thresholds does it here. The
    KV cache (larger than 32 MB) is still mapped on its own and lazily zeroed. A no-op without glibc."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3          # glibc's mallopt parameter numbers (malloc.h)
    libc.mallopt(m_mmap_threshold, 32 * 2**20)          # the largest value glibc accepts on 64-bit
    libc.mallopt(m_trim_threshold, 2**30)


@dataclass
class StepInputs:
    """One step's flat inputs as host lists: one row per token, decodes first, then prefill chunks."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]                 # cache slot each token's K/V is written to
    query_lens: list[int]            # per sequence: tokens in this step
    context_lens: list[int]          # per sequence: tokens in the cache once this step is written
    block_tables: list[list[int]]    # per sequence
    rows: list[int]                  # flat rows whose logits give a sequence's next token (a decode
                                     # verifying k drafts: its k + 1 rows, one per position)
    num_decodes: int                 # one-token decodes (the rows before any chunk or verifying decode)
    num_rows: list[int] = None       # per sequence that samples: its rows (1, or k + 1 when verifying)


def token_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of tokens start..end-1 of a sequence, one contiguous run per block."""
    slots = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        lo, hi = max(start, b * block_size), min(end, (b + 1) * block_size)
        base = table[b] * block_size - b * block_size
        slots.extend(range(base + lo, base + hi))
    return slots


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, folder: Path, max_model_len: int):
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype          # activations and KV cache ("int8": fp32, int8 linears)
        self.block_size = config.block_size
        cuda = self.device.type == "cuda"
        if self.device.type == "cpu":
            keep_freed_memory()
        free_at_start = torch.cuda.mem_get_info(self.device)[0] if cuda else 0   # the memory budget's base
        self.backend = select_backend(config.attention_backend, self.device, config.block_size, head_dim_of(hf_config),
                                      self.dtype)
        self.graphs: StepGraphs | None = None
        # enforce_eager: plain PyTorch, op by op
        self.model = load_model(folder, hf_config, config.dtype, self.device, self.backend, not config.enforce_eager)
        self.max_model_len = max_model_len
        self.eos_token_ids: frozenset[int] = frozenset()   # the engine's; the sampler bans them before min_tokens
        self.cos, self.sin = rope_table(hf_config, self.model.head_dim, max_model_len, self.dtype, self.device)

        # ---- paged KV cache: (layers, 2, num_blocks + 1, block_size, kv_heads, head_dim) ----
        # the extra block is scratch: padded tokens of a CUDA-graph step write there
        self.num_layers = hf_config.num_hidden_layers
        self.kv_heads, self.head_dim = hf_config.num_key_value_heads, self.model.head_dim
        if config.num_kv_blocks:
            self.num_blocks = config.num_kv_blocks
        elif cuda:
            self.num_blocks = self._blocks_left_after_warmup(config, free_at_start)
        else:
            self.num_blocks = max(2, int(config.kv_cache_gb * 2**30 // self.bytes_per_block))
        self.claim_kv_cache = config.claim_kv_cache
        self._allocate_cache(self.num_blocks + 1)
        self.scratch_block = self.num_blocks

        # ---- CUDA graphs: one per token bucket up to the token budget ----
        if cuda and not config.enforce_eager and self.backend.graphable:
            self.graphs = self.make_graphs(config.max_num_batched_tokens, config.max_num_seqs)

    def make_graphs(self, max_tokens: int, max_num_seqs: int, capture: bool = True) -> StepGraphs:
        """capture=False: the same static buffers and padding, run eagerly (tests, on a CPU)."""
        return StepGraphs(self.model, self.cos, self.sin, max_tokens, max_num_seqs, self.max_blocks_per_seq,
                          self.scratch_block * self.block_size, capture)

    def graph_stats(self) -> dict | None:
        """Buckets, capture time and graph memory (None: steps run eagerly)."""
        return self.graphs.stats() if self.graphs else None

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache's tensors, the scratch block included: the cache's share of memory."""
        return self.kv_cache.nbytes

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every linear and norm, and the logits matrix; not the
        embedding table, of which a step reads one row per token (its int8 copy, where there is one)."""
        m = self.model
        head = 0 if m.int8_head is not None else m.head_weight().nbytes    # an int8 head is one of the linears
        linears = sum(getattr(mod, "nbytes", 0) for mod in m.modules())          # engine.weights.quant.Int8Linear
        tied = ("embed_tokens.weight", "lm_head.weight")
        params = sum(p.nbytes for name, p in m.named_parameters() if name not in tied)
        return head + linears + params

    def _allocate_cache(self, num_blocks: int):
        # zeros, not empty: masked-out slots are still multiplied by 0, and garbage could be NaN
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.kv_heads, self.head_dim)
        self.kv_cache = None                  # let a previous cache go first
        self.kv_cache = _zeros(shape, self.dtype, self.device)
        if self.claim_kv_cache and self.device.type == "cpu":
            self.kv_cache.zero_()             # writes every page: resident now, as a busy server's cache becomes
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    def _blocks_left_after_warmup(self, config: EngineConfig, free_at_start: int) -> int:
        """CUDA: run the largest step the scheduler can form (a whole prompt of max_model_len tokens,
        or a full token budget) on a throwaway cache; the KV cache gets what the peak leaves of
        gpu_memory_utilization * the memory that was free before the weights were loaded."""
        n, cap = max(config.max_num_batched_tokens, self.max_model_len), self.max_model_len
        batch, blocks = Batch(), 0
        for i in range(0, n, cap):               # prompts no longer than the model's context
            m = min(cap, n - i)
            used = -(-m // self.block_size)
            seq = Sequence(f"warmup{i}", "warmup", [0] * m, SamplingParams(max_tokens=1), 0.0,
                           block_table=list(range(blocks, blocks + used)))
            batch.items.append((seq, m))
            blocks += used
        self._allocate_cache(blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run(batch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - blocks * self.bytes_per_block
        self.kv_cache = None
        for layer in self.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = None
        torch.cuda.empty_cache()
        budget = free_at_start * config.gpu_memory_utilization - peak
        if budget < 2 * self.bytes_per_block:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                               f"{free_at_start * config.gpu_memory_utilization / 2**30:.1f} GiB allowed)")
        return int(budget // self.bytes_per_block) - 1    # one block is the scratch block

    def clear_blocks(self, block_ids: list[int]):
        """Zero these blocks in every layer (a failed request's, whose values may be NaN)."""
        if block_ids:
            self.kv_cache[:, :, block_ids] = 0

    # ---- KV hand-over between engines (engine/disagg/router.py) ----
    def copy_blocks_out(self, block_ids: list[int], staging: torch.Tensor, slots: list[int]):
        """Block by block, cache -> staging[slot]. staging: (slots, layers, 2, block_size, kv_heads, head_dim)."""
        for block, slot in zip(block_ids, slots, strict=True):
            staging[slot].copy_(self.kv_cache[:, :, block])

    def copy_blocks_in(self, staging: torch.Tensor, slots: list[int], block_ids: list[int]):
        for slot, block in zip(slots, block_ids, strict=True):
            self.kv_cache[:, :, block].copy_(staging[slot])

    # ---- one step ----
    def prepare(self, batch: Batch) -> StepInputs:
        """The step's flat inputs, on the host."""
        bs = self.block_size
        decodes = [(s, n) for s, n in batch.items if s.is_prefill_done]
        assert batch.items[:len(decodes)] == decodes, "decodes must come first in the batch"
        single = sum(1 for _, n in decodes if n == 1)
        assert all(n == 1 for _, n in decodes[:single]), "one-token decodes come before those verifying drafts"
        # a decode verifying drafts is laid out like a chunk: its queries attend to the cache with a causal offset
        step = StepInputs([], [], [], [], [], [], [], single, [])
        for seq, n in batch.items:
            start, table = seq.num_computed_tokens, seq.block_table
            if seq.is_prefill_done and n == 1:
                step.input_ids.append(seq.output_token_ids[-1])
                step.slots.append(table[start // bs] * bs + start % bs)
            elif seq.is_prefill_done:       # its last token, then the drafts it verifies
                step.input_ids.append(seq.output_token_ids[-1])
                step.input_ids.extend(seq.draft_token_ids[:n - 1])
                step.slots.extend(token_slots(table, start, start + n, bs))
            else:
                p = seq.prompt_len
                step.input_ids.extend(seq.prompt_token_ids[start:start + n] if start + n <= p
                                      else seq.all_token_ids[start:start + n])
                step.slots.extend(token_slots(table, start, start + n, bs))
            step.positions.extend(range(start, start + n))
            step.query_lens.append(n)
            step.context_lens.append(start + n)
            step.block_tables.append(table)
            if seq.is_prefill_done and n > 1:
                step.rows.extend(range(len(step.input_ids) - n, len(step.input_ids)))
                step.num_rows.append(n)
            elif start + n == seq.num_tokens:
                step.rows.append(len(step.input_ids) - 1)
                step.num_rows.append(1)
        return step

    def upload(self, step: StepInputs):
        """All of the step's index lists in one host-to-device copy (from pinned memory on CUDA),
        then the metadata. Returns input_ids, positions, logit rows, metadata."""
        width = max(map(len, step.block_tables))
        # rows padded with the sequence's own first block: padding is read under a mask (torch decode groups),
        # and a masked NaN still spreads, so it must never be another request's block
        tables = [t + (t[:1] or [0]) * (width - len(t)) for t in step.block_tables]
        parts = [step.input_ids, step.positions, step.slots, step.rows, step.context_lens,
                 [0, *itertools.accumulate(step.query_lens)], [0, *itertools.accumulate(step.context_lens)],
                 list(itertools.chain.from_iterable(tables))]
        flat = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.long,
                            pin_memory=self.device.type == "cuda")
        flat = flat.to(self.device, non_blocking=True)
        ids, pos, slots, rows, ctx, cu_q, cu_k, tables_t = flat.split([len(p) for p in parts])
        nd = step.num_decodes
        meta = AttentionMetadata(slot_mapping=slots, context_lens=ctx, block_tables=tables_t.view(len(tables), width),
                                 num_decodes=nd, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(step.query_lens),
                                 max_seqlen_k=max(step.context_lens), decode_ctx=step.context_lens[:nd])
        if getattr(self.backend, "ragged", False):   # it reads the layout on the device: no per-chunk masks
            return ids, pos, rows, meta
        q_start = nd
        for i in range(nd, len(step.query_lens)):
            n, ctx_len = step.query_lens[i], step.context_lens[i]
            mask = None
            if ctx_len > n:   # earlier chunks (or a cached prefix) are in the cache: causal mask with an offset
                mask = torch.arange(ctx_len, device=self.device)[None] <= pos[q_start:q_start + n, None]
            table = meta.block_tables[i, :len(step.block_tables[i])]
            meta.prefills.append(PrefillChunk(q_start, n, ctx_len, table, mask))
            q_start += n
        return ids, pos, rows, meta

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int | None]:
        """One forward pass. Returns the sampled token of each sequence that completed its known tokens,
        in batch order (decodes, then prefills whose chunk finishes the prompt); None for bad logits."""
        step = self.prepare(batch)
        # a bucket's sample rows are its sequence slots: a verifying decode takes one per position
        size = self.graphs.bucket(len(step.input_ids), max(len(batch.items), len(step.rows))) if self.graphs else None
        if size:
            logits = self.graphs.run(step, size)
        else:                 # eager: CPU, the torch backend, or a step above the largest bucket
            input_ids, positions, rows, meta = self.upload(step)
            set_metadata(meta)
            hidden = self.model(input_ids, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
            set_metadata(None)
            logits = self.model.compute_logits(hidden[rows]) if step.rows else None
        if not step.rows:
            return []
        seqs = [s for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens
                or (s.is_prefill_done and n > 1)]
        if len(step.rows) == len(seqs):     # no drafts to verify: one row per sequence
            return sample(logits, seqs, self.eos_token_ids)
        return sample_runs(logits, seqs, step.num_rows, self.eos_token_ids)
