"""The fast attention backends, each behind TorchAttention's call (engine/execution/attention.py), and
the choice between them (select_backend, from EngineConfig.attention_backend):
  CpuAttention        CPU: decodes by the paged kernel of engine/kernels/, which reads each
                      sequence's blocks in place; fresh fp32 prompt chunks by its causal kernel.
  TritonAttention     CUDA: the whole batch, decodes and chunks, in one launch
                      of a Triton kernel that reads the cache by block table and
                      finds each token's sequence on the device (graph-capturable
                      at a padded token bucket).
  FlashAttention      flash-attn reading block tables directly (CUDA, when the
                      package is installed and block_size % 256 == 0; eager).
Each gives TorchAttention's values up to rounding (tests/test_cpu_kernels.py, tests/test_gpu_path.py), and
attention_backend="torch" takes the plain path everywhere.
"""
from __future__ import annotations

import os

import torch

from engine.execution.attention import AttentionMetadata, PrefillChunk, TorchAttention, write_cache


class CpuAttention(TorchAttention):
    """CPU: decodes by the paged kernel (engine/kernels/cpu_kernels.cpp), which reads each sequence's blocks in
    place: no gather, no padding, no mask; fresh fp32 prompt chunks by the causal kernel there too; other
    prefill chunks as TorchAttention. The decode kernel sets how a block
    holds its tokens, so this backend writes and reads the cache in that layout (the runner's cache
    shape, block ids and block-level copies are the same; only the order inside a block differs):
      key block   (kv_heads, head_dim, block_size)   keys transposed: a block's scores are vector FMAs
      value block (kv_heads, block_size, head_dim)"""
    name = "cpu-paged"

    def __init__(self):
        from engine.kernels import ops
        self.kernel, self.write_kv = ops.paged_decode, ops.write_kv

    @staticmethod
    def views(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
        nb, bs, kvh, d = k_cache.shape
        return k_cache.view(nb, kvh, d, bs), v_cache.view(nb, kvh, bs, d)

    def write(self, k, v, k_cache, v_cache, meta: AttentionMetadata):
        """Each token into its block's layout."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def context(self, k_cache, v_cache, c: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        kt, vt = self.views(k_cache, v_cache)
        kvh, d = kt.shape[1], kt.shape[2]
        kc = kt[c.block_table].permute(1, 0, 3, 2).reshape(kvh, -1, d)[:, :c.ctx_len].unsqueeze(0)
        vc = vt[c.block_table].transpose(0, 1).reshape(kvh, -1, d)[:, :c.ctx_len].unsqueeze(0)
        return kc, vc

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.kernel(q, k_cache, v_cache, meta.block_tables, meta.context_lens)

    def causal(self, q, k, v, m: int) -> torch.Tensor:
        from engine.kernels import ops  # fp32 on AVX-512: the kernel; otherwise SDPA
        out = ops.causal_prefill_or_none(q, k, v, m)
        return super().causal(q, k, v, m) if out is None else out


class TritonAttention:
    """The whole ragged batch, decodes and chunks, in one launch of the unified kernel
    (engine/execution/triton_attention.py); its grid follows only the batch's (padded) shapes, so a step
    padded to a token bucket is captured once and replayed (engine/execution/cuda_graph.py)."""
    name = "triton-unified"
    graphable = True
    ragged = True                    # reads cu_seqlens_q and block tables on the device: no PrefillChunk list

    def __init__(self, num_sms: int):
        from engine.execution import triton_attention
        self.kernel = triton_attention
        self.num_sms = num_sms

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        splits, block_m = self.launch(q.shape[0], *meta.block_tables.shape, q.shape[1] // k_cache.shape[2],
                                      k_cache.shape[2])
        return self.kernel.unified_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                             meta.context_lens, splits, block_m)

    def launch(self, num_tokens: int, num_seqs: int, max_blocks: int, group: int, kv_heads: int) -> tuple[int, int]:
        """(split-K ranges, rows per program) from shapes only (the same for every replay of a bucket).
        Decode-like batches (about one token per sequence) take 16-row tiles and split-K when there are
        few of them; batches with prefill chunks take 64-row tiles, so a chunk's K/V is re-read by fewer
        programs, and have programs enough without splitting."""
        if num_tokens > 2 * num_seqs:
            return 1, 64
        work = min(num_tokens, self.kernel.num_qblocks(num_tokens, num_seqs, self.kernel.block_q_for(group)))
        return decode_splits(work, kv_heads, max_blocks, self.num_sms), 16


def decode_splits(num_seqs: int, kv_heads: int, max_blocks: int, num_sms: int) -> int:
    """Split-K for decode-like batches: ranges to cut each sequence's blocks into. Enough programs for
    two waves over the GPU, at least 8 blocks per range, at most 16 ranges; host-known sizes only."""
    want = -(-2 * num_sms // (num_seqs * kv_heads))
    return max(1, min(want, max_blocks // 8, 16))


class FlashAttention:
    """flash-attn 2 with a paged KV cache (its paged kernels need block_size % 256 == 0). Eager only: it
    reads host-side maxima (max_seqlen_q/k) and picks its kernel by whether the step has chunks."""
    name = "flash-attn"
    graphable = False

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if "i32" not in meta.derived:   # flash-attn takes int32 indices
            meta.derived["i32"] = meta.context_lens.int(), meta.block_tables.int()
        ctx, tables = meta.derived["i32"]
        if not meta.prefills:           # decode only, fixed shapes: the CUDA-graph path
            return self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx, block_table=tables,
                                     causal=True).squeeze(1)
        return self.varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q.int(),
                           cu_seqlens_k=meta.cu_seqlens_k.int(), max_seqlen_q=meta.max_seqlen_q,
                           max_seqlen_k=meta.max_seqlen_k, causal=True, block_table=tables)


def select_backend(name: str, device: torch.device, block_size: int, head_dim: int,
                   dtype: torch.dtype = torch.float32):
    """auto: on CUDA the Triton kernel where the tile sizes suit it (every step a CUDA graph), else
    flash-attn where installed and the block size suits it (eager), else torch; on CPU the paged
    decode kernel where it builds and has this dtype and shape (engine/kernels/cpu_kernels.py), else torch."""
    cuda = device.type == "cuda"
    if device.type == "cpu" and name in ("auto", "cpu"):
        from engine.kernels import cpu_kernels
        if cpu_kernels.supports(dtype, block_size, head_dim):
            return CpuAttention()
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu' needs a C++ compiler, float32 or bfloat16 and (block_size, "
                             f"head_dim) in {sorted(cpu_kernels.SHAPES)}; got {dtype}, ({block_size}, {head_dim})")
    flash_ok = cuda and block_size % 256 == 0 and _installed("flash_attn")
    ampere = cuda and torch.cuda.get_device_capability(device) >= (8, 0)   # A10G, A100, L4, L40S, H100...
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"   # Triton runs the kernel on CPU tensors: tests
    triton_ok = (ampere or interpreted) and kernel_supports(block_size, head_dim) and _installed("triton")
    if name == "flash_attn" and not flash_ok:
        raise ValueError("attention_backend='flash_attn' needs CUDA, the flash-attn package and block_size % 256 == 0")
    if name == "triton" and not triton_ok:
        raise ValueError("attention_backend='triton' needs a CUDA GPU of compute capability 8.0 or newer, the "
                         "triton package, a power-of-two block_size and a power-of-two head_dim >= 16")
    if name == "triton" or (name == "auto" and cuda and triton_ok):
        return TritonAttention(torch.cuda.get_device_properties(device).multi_processor_count if cuda else 8)
    if name == "flash_attn" or (name == "auto" and flash_ok):
        return FlashAttention()
    return TorchAttention()


def kernel_supports(block_size: int, head_dim: int) -> bool:
    """The Triton kernel's tiles need a power-of-two head_dim of at least 16 (tl.dot) and a power-of-two block."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0


def _installed(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False
