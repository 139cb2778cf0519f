"""A Llama-family decoder over a flat token dimension.

One class covers Llama, Mistral, SmolLM2 (Llama), Qwen2 (q/k/v bias) and Qwen3
(RMSNorm on q and k per head). Every tensor is (num_tokens, ...): there is no
batch or padding dimension; which token belongs to which sequence is known
only to attention, through the step's AttentionMetadata.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from engine.attention import get_metadata

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 like the reference implementation, so fp32 outputs match bit for bit
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (num_tokens, heads, head_dim); cos, sin: (num_tokens, 1, head_dim)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, backend):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))   # Llama-style: on q, k, v and o
        qkv_bias = bias or cfg.model_type == "qwen2"         # Qwen2: on q, k, v only
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)  # q, k, v fused
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=bias and cfg.model_type != "qwen2")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.layer_idx = layer_idx
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)   # views into the runner's cache, set after start-up

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)       # (num_tokens, heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)    # (num_tokens, kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.backend(q, k, v, self.k_cache, self.v_cache, get_metadata())
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate, up fused
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, backend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # checkpoint names -> (our fused parameter, which shard)
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, backend):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # input_ids: (num_tokens,); cos, sin: (num_tokens, 1, head_dim) -> hidden (num_tokens, hidden)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight)

    def load_checkpoint(self, tensors):
        """tensors: iterable of (checkpoint name, tensor) in Hugging Face naming."""
        params = dict(self.named_parameters())
        shards: dict[str, list] = {}
        loaded = set()
        tied_head = None
        for name, t in tensors:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                tied_head = t           # some savers keep only this copy of a tied matrix
                continue
            if "rotary_emb" in name:
                continue
            leaf = name.split(".")[-2] if "." in name else name
            if leaf in self.packed:
                fused, idx = self.packed[leaf]
                key = name.replace(leaf, fused)
                shards.setdefault(key, [None] * (3 if fused == "qkv_proj" else 2))[idx] = t
                if all(s is not None for s in shards[key]):
                    self._assign(params, key, torch.cat(shards.pop(key)), loaded)
            else:
                self._assign(params, name, t, loaded)
        if "embed_tokens.weight" not in loaded and tied_head is not None:
            self._assign(params, "embed_tokens.weight", tied_head, loaded)
        missing = set(params) - loaded
        if missing or shards:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(shards))[:8]}")

    @staticmethod
    def _assign(params, name, t, loaded):
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r}")
        p = params[name]
        if p.shape != t.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t)
        loaded.add(name)
