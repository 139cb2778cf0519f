"""int8 linears for CPUs: dtype="int8".

The matmul is fbgemm's dynamic int8 GEMM (torch.ops.quantized.linear_dynamic):
weights int8 with one scale per output channel, activations quantised on the
fly with one scale per call (7 bits: AVX2's multiply-adds would saturate with
8). It is the only one of torch's int8 and int4 CPU kernels that was faster
than fp32 in the side-by-side table of docs/results.md ("Weight formats for
the linears"), which names the CPU it ran on.

One scale for all of a step's activations is what breaks small models: a few
input channels are two orders of magnitude larger than the rest and take the
whole range, and perplexity doubles. So, as in SmoothQuant, each linear's input channels
are divided by s_j = amax_j^0.7 / wmax_j^0.3 (amax from a calibration text,
wmax of the weight's column) and its weight columns multiplied by s_j. The
division is free: it folds into whatever makes the input. For q/k/v, gate/up
and the logits head that is the RMSNorm weight before them; for o_proj the
v rows of qkv_proj (attention mixes v over tokens, channel by channel).
down_proj stays fp32: its input, silu(gate) * up, has channels thousands of
times the median that neither smoothing nor keeping the largest in fp32 tames,
and even fp16 weights cost perplexity there (docs/results.md, "int8 quality").
The other linears are most of the bytes a decode step reads.

Quantised once (engine.weights.loader prepares it for the default model) and cached
beside the fp32 safetensors as INT8_FILE, stamped with the scheme and the fp32
files' sizes and mtimes so new weights (or a new scheme) rebuild it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

INT8_FILE = "int8/linears.safetensors"   # a subfolder: loaders that read every *.safetensors never see it
SCHEME = "norms+v-rows"   # in the stamp: a cache made by another scheme is rebuilt, never misread
ALPHA = 0.7          # smoothing strength: 0 leaves the activations alone, 1 moves all their range to the weights
# calibration input: everyday English, not the text demos.compare.quality measures perplexity on
CALIBRATION_TEXT = (
    "You are a helpful assistant. Answer the question briefly and clearly.\n"
    "User: How do I repair a puncture on a bicycle tyre? Please list the steps.\n"
    "Assistant: First remove the wheel and take the tyre off with two levers. Pump up the tube and listen for "
    "the hole, or hold it under water and look for bubbles. Roughen the area with sandpaper, spread a thin layer "
    "of glue, wait a minute and press the patch on firmly. Check the inside of the tyre for the thorn or glass "
    "that caused it, put the tube back, refit the tyre and pump it to the pressure printed on its side.\n"
    "User: Thanks! And what is 17 times 23? Also, translate 'thank you' into French and Spanish.\n"
    "Assistant: 17 x 23 = 391. 'Thank you' is 'merci' in French and 'gracias' in Spanish.\n"
    "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)\n"
)


def int8_available() -> bool:
    """fbgemm ships with x86 builds of torch; ARM builds have no fast int8 dynamic linear."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: (out, in) float -> q: (out, in) int8, scale: (out,) fp32, with w ~= q * scale[:, None]."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, through fbgemm's packed int8 GEMM. x: (..., in) fp32."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, bias)
        self.nbytes = q.numel() + scale.numel() * 4 + (bias.numel() * 4 if bias is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)   # True: 7-bit activations (AVX2)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def smoothed(model: nn.Module) -> list[tuple[str, str]]:
    """(where a linear's smoothing division folds, the linear) for each int8 linear and the head. The fold
    is the RMSNorm weight before it, or for o_proj the v rows of qkv_proj: attention's output channel
    (head, d) is a mix over tokens of v's channel (the head's kv head, d)."""
    pairs = [("norm", "head")]
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        pairs += [(p + "input_layernorm", p + "self_attn.qkv_proj"),
                  (p + "self_attn.qkv_proj:v", p + "self_attn.o_proj"),
                  (p + "post_attention_layernorm", p + "mlp.gate_up_proj")]
    return pairs


@torch.inference_mode()
def input_absmax(model: nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |activation| each linear sees over one prefill of `ids`, by linear name."""
    from engine.execution.attention import AttentionMetadata, PrefillChunk, TorchAttention, set_metadata
    from engine.models.llama import rope_table
    n, amax, hooks = len(ids), {}, []
    for _, name in smoothed(model)[1:]:    # the layers' linears; the head's input is the model's output
        def hook(mod, inp, name=name):
            amax[name] = inp[0].detach().abs().amax(0)
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    saved = [(a.backend, a.k_cache, a.v_cache) for a in (layer.self_attn for layer in model.layers)]
    attn0 = model.layers[0].self_attn
    for layer in model.layers:        # a cache of one block holding the whole text
        a = layer.self_attn
        a.backend = TorchAttention()
        a.k_cache = a.v_cache = torch.zeros(1, n, a.num_kv_heads, a.head_dim)
    try:
        cos, sin = rope_table(model.cfg, attn0.head_dim, n, torch.float32, "cpu")
        pos = torch.arange(n)
        set_metadata(AttentionMetadata(slot_mapping=pos, context_lens=torch.tensor([n]),
                                       block_tables=torch.zeros(1, 1, dtype=torch.long),
                                       prefills=[PrefillChunk(0, n, n, torch.zeros(1, dtype=torch.long), None)]))
        amax["head"] = model(torch.tensor(ids), cos[:, None], sin[:, None]).abs().amax(0)
    finally:
        set_metadata(None)
        for h in hooks:
            h.remove()
        for layer, (b, k, v) in zip(model.layers, saved):
            layer.self_attn.backend, layer.self_attn.k_cache, layer.self_attn.v_cache = b, k, v
    return amax


def smoothing(amax: torch.Tensor, w: torch.Tensor, heads: tuple[int, int, int] | None = None) -> torch.Tensor:
    """s_j = amax_j^ALPHA / wmax_j^(1 - ALPHA) for each input channel j of w: (out, in). heads (o_proj):
    (kv_heads, group, head_dim), the layout of its input; one v channel feeds a whole group of heads,
    so the maxima are taken over the group and s is the same across it."""
    wmax = w.abs().amax(0)
    if heads:
        amax, wmax = (t.view(heads).amax(1, keepdim=True) for t in (amax, wmax))
    s = amax.clamp(min=1e-5) ** ALPHA / wmax.clamp(min=1e-5) ** (1 - ALPHA)
    return s.expand(heads).flatten() if heads else s


def smooth(model: nn.Module, amax: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """The smoothed fp32 weights and biases of each int8 linear, and the norm weights that feed them
    (all by name), from the activation maxima. A linear's input channels are divided by its s where
    they are made (the norm's weight, or v's rows of qkv_proj) and its weight columns multiplied by s:
    every product is unchanged, the activations' range moves into the weights."""
    attn = model.layers[0].self_attn
    heads = (attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim)   # o_proj's input layout
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
    weights = {name: (model.head_weight() if name == "head" else model.get_submodule(name).weight).float().clone()
               for _, name in smoothed(model)}
    biases = {name: None if name == "head" or model.get_submodule(name).bias is None
              else model.get_submodule(name).bias.float().clone() for _, name in smoothed(model)}
    norms = {}
    for fold, name in smoothed(model):      # in forward order: qkv_proj's s is taken before its v rows change
        o_proj = fold.endswith(":v")
        s = smoothing(amax[name], weights[name], heads if o_proj else None)
        weights[name] *= s                                       # columns
        if not o_proj:
            norms[fold] = model.get_submodule(fold).weight / s
            continue
        qkv = fold.removesuffix(":v")
        s = s.view(heads)[:, 0].flatten()                        # one factor per v channel: (kv_heads * head_dim,)
        weights[qkv][v_rows] /= s[:, None]
        if biases[qkv] is not None:
            biases[qkv][v_rows] /= s
    return weights, biases, norms


def quantize_model(model: nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """The int8 tensors of a loaded fp32 model, calibrated on `ids`: per int8 linear '<linear>.q', '.scale'
    (and '.bias'), and the smoothed '<norm>.weight' of each norm that feeds one."""
    weights, biases, norms = smooth(model, input_absmax(model, ids))
    out = {f"{norm}.weight": w for norm, w in norms.items()}
    for name, w in weights.items():
        out[f"{name}.q"], out[f"{name}.scale"] = quantize_per_channel(w)
        if biases[name] is not None:
            out[f"{name}.bias"] = biases[name].contiguous()
    return out


def apply_int8(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """Swap each smoothed nn.Linear for its Int8Linear (the head: model.int8_head), smoothed norms in."""
    for fold, name in smoothed(model):
        if f"{name}.q" not in tensors:
            raise ValueError(f"int8 weights have no entry for {name!r}: delete {INT8_FILE} to rebuild it")
        if not fold.endswith(":v"):
            model.get_submodule(fold).weight.copy_(tensors[f"{fold}.weight"])
        layer = Int8Linear(tensors[f"{name}.q"], tensors[f"{name}.scale"], tensors.get(f"{name}.bias"))
        if name == "head":
            model.int8_head = layer
        else:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer)


def load_or_make_int8(model: nn.Module, folder: Path) -> Path | None:
    """Quantise the fp32 model in place, reading the cached int8 tensors from `folder` when they are
    there and fresh, else computing them and writing them when the folder is writable.
    Returns the cache file, or None if the folder is read-only (then it is computed at each start)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    path, stamp = folder / INT8_FILE, _stamp(folder)
    if path.exists():
        with safe_open(str(path), framework="pt") as f:
            fresh = (f.metadata() or {}).get("source") == stamp
        if fresh:
            apply_int8(model, load_file(str(path)))
            return path
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(folder)(CALIBRATION_TEXT)["input_ids"]
    tensors = quantize_model(model, ids)
    apply_int8(model, tensors)
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".part")
        save_file(tensors, str(tmp), metadata={"source": stamp})
        tmp.rename(path)                      # atomic: a half-written cache is never read
        return path
    except OSError:                           # a read-only folder (a shared Hub cache)
        return None


def _stamp(folder: Path) -> str:
    """Sizes and mtimes of the fp32 weight files the int8 cache was made from."""
    files = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
                     for f in sorted(folder.glob("*.safetensors")))
    return f"{SCHEME};alpha={ALPHA};{files}"
