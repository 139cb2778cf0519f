"""The model runner: a Batch of (sequence, num_tokens) in, one forward pass, next tokens out.

It owns the weights, the paged KV cache and the RoPE table, flattens the step's
tokens into one ragged batch (decodes first, then prefill chunks), builds the
step's AttentionMetadata, runs the model once and samples.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.attention import AttentionMetadata, PrefillChunk, select_backend, set_metadata
from engine.config import EngineConfig
from engine.models import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from engine.sampler import sample
from engine.scheduler import Batch


def check_architecture(hf_config):
    archs = getattr(hf_config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and hf_config.model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(f"unsupported model architecture {archs or hf_config.model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def load_safetensors(folder: Path):
    from safetensors import safe_open
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def rope_table(hf_config, head_dim: int, max_len: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_len, head_dim), with the config's theta and scaling (transformers computes the latter)."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scale = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(device, dtype), (emb.sin() * scale).to(device, dtype)


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # numpy's calloc hands back lazily zeroed pages: a 1 GB cache costs nothing until it is used
    import numpy as np
    raw = np.zeros(int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, weights, max_model_len: int | None = None):
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        check_architecture(hf_config)
        self.backend = select_backend(config.attention_backend, self.device, config.block_size)

        # ---- weights ----
        with torch.device("meta"):            # no time spent initialising weights we overwrite
            self.model = LlamaForCausalLM(hf_config, self.backend).to(self.dtype)
        self.model.to_empty(device=self.device)
        self.model.load_checkpoint(weights)
        self.model.eval().requires_grad_(False)

        self.max_model_len = max_model_len
        self.cos, self.sin = rope_table(hf_config, self.model.head_dim, max_model_len, self.dtype, self.device)

        # ---- paged KV cache: (layers, 2, num_blocks, block_size, kv_heads, head_dim) ----
        self.num_layers = hf_config.num_hidden_layers
        self.kv_heads, self.head_dim = hf_config.num_key_value_heads, self.model.head_dim
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit(config)
        # zeros, not empty: masked-out slots are still multiplied by 0, and garbage could be NaN
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        self.kv_cache = _zeros(shape, self.dtype, self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    def _blocks_that_fit(self, config: EngineConfig) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * config.gpu_memory_utilization
        else:
            budget = config.kv_cache_gb * 2**30
        return max(2, int(budget // self.bytes_per_block))

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # ---- one step ----
    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Flat inputs and metadata for the batch. Returns input_ids, positions, logit rows."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        decode_slots: list[int] = []
        slot_parts: list[torch.Tensor] = []
        pos_parts: list[torch.Tensor] = []
        rows: list[int] = []                          # flat row whose logits pick a sequence's next token
        decodes = [(s, n) for s, n in batch.items if s.is_prefill_done]
        prefills = [(s, n) for s, n in batch.items if not s.is_prefill_done]
        assert batch.items[:len(decodes)] == decodes, "decodes must come first in the batch"

        decode_pos = []
        for seq, _ in decodes:
            p = seq.num_computed_tokens
            ids.append(seq.output_token_ids[-1])
            decode_pos.append(p)
            decode_slots.append(seq.block_table[p // bs] * bs + p % bs)
            rows.append(len(rows))
        meta = AttentionMetadata(slot_mapping=None, num_decodes=len(decodes))
        if decodes:
            max_blocks = max(len(s.block_table) for s, _ in decodes)
            tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s, _ in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=dev)
            ctx = torch.tensor(decode_pos, device=dev) + 1
            meta.decode_mask = (torch.arange(max_blocks * bs, device=dev)[None] < ctx[:, None])[:, None, None]
            pos_parts.append(ctx - 1)
            slot_parts.append(torch.tensor(decode_slots, dtype=torch.long, device=dev))

        q_start = len(decodes)
        for seq, n in prefills:
            start = seq.num_computed_tokens
            p = seq.prompt_len
            ids.extend(seq.prompt_token_ids[start:start + n] if start + n <= p else seq.all_token_ids[start:start + n])
            pos = torch.arange(start, start + n, device=dev)
            table = torch.tensor(seq.block_table, dtype=torch.long, device=dev)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            pos_parts.append(pos)
            mask = None
            if start > 0:   # earlier chunks (or a cached prefix) are in the cache: causal mask with an offset
                mask = torch.arange(start + n, device=dev)[None] <= pos[:, None]
            meta.prefills.append(PrefillChunk(q_start, n, start + n, table, mask))
            if start + n == seq.num_tokens:
                rows.append(q_start + n - 1)
            q_start += n

        meta.slot_mapping = torch.cat(slot_parts)
        set_metadata(meta)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.cat(pos_parts)
        return input_ids, positions, rows

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int | None]:
        """One forward pass. Returns the sampled token of each sequence that completed its known tokens,
        in batch order (decodes, then prefills whose chunk finishes the prompt); None for bad logits."""
        input_ids, positions, rows = self.prepare(batch)
        hidden = self.model(input_ids, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        set_metadata(None)
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[rows])
        seqs = [s for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens]
        return sample(logits, seqs)
