"""Attention over a flat ragged batch that reads and writes the paged KV cache.

A step's tokens are one flat dimension: first one token per decoding sequence,
then the prefill chunks. Everything attention needs to know about that layout
travels in one per-step AttentionMetadata (set by the model runner, read by
every layer), not through the forward signatures.

Backends share one call: backend(q, k, v, k_cache, v_cache, meta) -> out.
  TorchAttention      portable (CPU and CUDA): all decodes in one batched SDPA
                      call over their gathered blocks, one call per prefill chunk.
  FlashAttention      flash-attn's varlen kernel reading block tables directly
                      (CUDA, when the package is installed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    q_start: int               # first row of this chunk in the flat batch
    q_len: int                 # tokens in the chunk
    ctx_len: int               # tokens of the sequence in the cache once the chunk is written
    block_table: torch.Tensor  # (num_blocks,) long
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, None when the chunk starts the sequence


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # (num_tokens,) cache slot of each token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None   # (num_decodes, max_blocks)
    decode_mask: torch.Tensor | None = None           # (num_decodes, 1, 1, max_blocks * block_size)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # flash-attn varlen layout (built only for that backend)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_tables: torch.Tensor | None = None          # (num_seqs, max_blocks)


_META: AttentionMetadata | None = None


def set_metadata(meta: AttentionMetadata | None):
    global _META
    _META = meta


def get_metadata() -> AttentionMetadata:
    return _META


def write_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor):
    """k, v: (num_tokens, kv_heads, head_dim) -> their slots in (num_blocks, block_size, kv_heads, head_dim)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


class TorchAttention:
    name = "torch-sdpa"

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        # q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim)
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            # gather each decode's blocks: (nd, max_blocks * block_size, kv_heads, head_dim)
            kc = k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
            vc = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kc, vc, attn_mask=meta.decode_mask,
                                               enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for c in meta.prefills:
            qc = q[c.q_start:c.q_start + c.q_len].transpose(0, 1).unsqueeze(0)  # (1, heads, q_len, head_dim)
            if c.mask is None:   # the chunk is the whole context so far: plain causal attention
                kc = k[c.q_start:c.q_start + c.q_len].transpose(0, 1).unsqueeze(0)
                vc = v[c.q_start:c.q_start + c.q_len].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
            else:                # earlier chunks (or cached prefix) come from the paged cache
                kc = k_cache[c.block_table].flatten(0, 1)[:c.ctx_len].transpose(0, 1).unsqueeze(0)
                vc = v_cache[c.block_table].flatten(0, 1)[:c.ctx_len].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, enable_gqa=True)
            out[c.q_start:c.q_start + c.q_len] = o.squeeze(0).transpose(0, 1)
        return out


class FlashAttention:
    """flash-attn 2 varlen with a paged KV cache (block_size must be a multiple of 256 for flash-attn 2)."""
    name = "flash-attn"

    def __init__(self):
        from flash_attn import flash_attn_varlen_func
        self.fn = flash_attn_varlen_func

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.fn(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                       max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, causal=True,
                       block_table=meta.block_tables)


def select_backend(name: str, device: torch.device, block_size: int):
    """auto: flash-attn where it is installed, on CUDA, and the block size suits it; else torch."""
    if name == "torch":
        return TorchAttention()
    usable = device.type == "cuda" and block_size % 256 == 0 and _flash_attn_installed()
    if name == "flash_attn" and not usable:
        raise ValueError("attention_backend='flash_attn' needs CUDA, the flash-attn package and block_size % 256 == 0")
    return FlashAttention() if usable else TorchAttention()


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
        return True
    except Exception:
        return False
