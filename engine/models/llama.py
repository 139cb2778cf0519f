"""A Llama-family decoder over a flat token dimension.

One class covers Llama, Mistral, SmolLM2 (Llama), Qwen2 (q/k/v bias) and Qwen3
(RMSNorm on q and k per head). Every tensor is (num_tokens, ...): there is no
batch or padding dimension; which token belongs to which sequence is known
only to attention, through the step's AttentionMetadata.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.execution.attention import get_metadata
from engine.kernels import cpu_kernels, ops
from engine.kernels.reference import add_rms_norm, apply_rope, rms_norm, silu_and_mul  # noqa: F401 (the plain path)
from engine.models import fast_paths
from engine.models.fast_paths import FusedOps, Linear, linear, packed_linear

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def rope_table(hf_config, head_dim: int, max_len: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_len, head_dim), with the config's theta and scaling (transformers computes the latter).
    sin's first half is negated: models.llama.apply_rope rotates by a roll, not by rotate_half."""
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
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), -1).to(device, dtype), torch.cat((-sin, sin), -1).to(device, dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: FusedOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, backend, ops: FusedOps):
        super().__init__()
        self.ops = ops
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))   # Llama-style: on q, k, v and o
        qkv_bias = bias or cfg.model_type == "qwen2"         # Qwen2: on q, k, v only
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)  # q, k, v fused
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=bias and cfg.model_type != "qwen2")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.layer_idx = layer_idx
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)   # views into the runner's cache, set after start-up

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, h + 2 * kvh, self.head_dim)   # (num_tokens, heads + 2 kv_heads, head_dim)
        qk, v = qkv[:, :h + kvh], qkv[:, h + kvh:]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = self.ops.apply_rope(qk, cos, sin)              # q's and k's heads in one go
        q, k = qk[:, :h], qk[:, h:]                          # (num_tokens, heads | kv_heads, head_dim)
        o = self.backend(q, k, v, self.k_cache, self.v_cache, get_metadata())
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg, ops: FusedOps):
        super().__init__()
        self.ops = ops
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate, up fused
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x), self.inter))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, backend, ops: FusedOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer_idx, backend, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, x, residual, cos, sin):
        """x: the previous layer's output; residual: the stream it adds to (None in the first layer).
        Each residual add is fused into the norm that follows it. Returns (mlp output, residual)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint names -> (our fused parameter, which shard)
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, backend, compile_on_cuda: bool = True):
        super().__init__()
        self.cfg = cfg
        self.ops = ops = FusedOps(compile_on_cuda)
        # given its weight, the embedding skips its random init (on the meta device that init alone imports
        # torch._dynamo: a second of CPU in every process that loads a model)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, ops) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.int8_head = None        # engine.weights.quant sets it for dtype="int8"
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # input_ids: (num_tokens,); cos, sin: (num_tokens, 1, head_dim) -> hidden (num_tokens, hidden)
        x, residual, meta = self.embed_tokens(input_ids), None, get_metadata()
        if self.fused_decode and x.shape[0] <= self.fused_rows and not meta.prefills:
            a = self.layers[0].self_attn
            residual = ops.decode_step(x, cos, sin, meta, self.decode_weights(), heads=a.num_heads,
                                       kv_heads=a.num_kv_heads, eps=self.cfg.rms_norm_eps)
            return self.norm.add_forward(x, residual)[0]
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        return self.norm.add_forward(x, residual)[0]

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.int8_head is not None:
            return self.int8_head(hidden)
        if self.amx_head is not None and hidden.shape[0] <= cpu_kernels.AMX_ROWS:
            return ops.linear_amx(hidden, self.amx_head, self.cfg.vocab_size)
        if self.f32_head is not None and hidden.shape[0] <= self.f32_rows:
            return ops.linear_f32(hidden, self.f32_head, self.cfg.vocab_size)
        if self.packed_head is not None:
            return packed_linear(hidden, self.packed_head)
        return linear(hidden, self.head_weight())

    packed_head: torch.Tensor | None = None
    amx_head: torch.Tensor | None = None
    f32_head: torch.Tensor | None = None
    f32_rows = 0                    # up to this many rows the f32 head (with AVX2, oneDNN's above: pack_weights)
    # a decode step's layers in one call of the CPU kernels (engine/kernels/ops.decode_step): set by
    # pack_weights where every piece of a layer has its kernel; demos/profile_serving turns it off to time
    # the pieces one by one
    fused_decode = False
    fused_rows = 0                  # up to this many sequences (the linears' kernel's rows)

    def decode_weights(self) -> dict[str, list[torch.Tensor]]:
        return fast_paths.decode_weights(self)

    def pack_weights(self):
        """The CPU kernels' copies of the weights, where they compute what F.linear does (fast_paths.pack_weights)."""
        fast_paths.pack_weights(self)

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
