"""Reading a loaded transformers model into the fast runner's weights.

Design note: the fast runner does not load checkpoints itself. It takes the model object the
shard already loaded (fp32, bf16, or bitsandbytes int8/nf4/fp4), so there is one loading path
and the fallback runner and the layer-skip identity map see the same weights.

- Dense linears (`nn.Linear`) are fused: q/k/v into one `[q+2kv, hidden]` matrix, gate/up
  into one `[2 * intermediate, hidden]` matrix. When the dtype does not change, the original
  modules' parameters are re-pointed at row slices of the fused matrix (same values), so the
  fused copy costs no extra memory and the transformers model keeps working.
- bitsandbytes linears (`Linear8bitLt`, `Linear4bit`) are kept as modules here; with the CPU
  kernels, kernel_weights.py reads their packed weights as they are (and fuses them), else they
  are called as they are.
- Gemma's RMSNorm multiplies by `1 + weight`: the `1 +` is folded in here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# model_type -> family. Gemma 3 differs by its sandwich norms, q/k norms, scaled embeddings,
# GELU and sliding-window layers; the rest of the code is shared.
FAST_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "gemma3_text": "gemma3",
}
# Rope types whose frequencies depend on the sequence length at run time: not table-friendly.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")

# A projection is a dense weight `[out, in]`, or bitsandbytes modules called in turn and
# concatenated along the output dimension.
Projection = torch.Tensor | tuple[nn.Module, ...]


@dataclass(frozen=True)
class ArchSpec:
    """Architecture facts of one model, read once from its config and modules.

    Attributes:
        model_type: the config's model_type (e.g. "llama", "gemma3_text").
        family: "llama" or "gemma3".
        num_heads / num_kv_heads / head_dim: attention geometry.
        attention_scale: the softmax scale the model uses (Gemma: query_pre_attn_scalar**-0.5).
        rms_norm_eps: epsilon of every RMSNorm.
        activation: "silu" or "gelu_tanh" (the MLP gate activation).
        embed_scale: multiplier of the embeddings (Gemma: sqrt(hidden)), None for none.
        final_logit_softcap: tanh soft cap of the logits, None for none.
        sliding_windows: per layer, the attention window in tokens, None for full attention.
        rope_keys: per layer, which rope table the layer uses ("default" or a layer type).
    """

    model_type: str
    family: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_scale: float
    rms_norm_eps: float
    activation: str
    embed_scale: float | None
    final_logit_softcap: float | None
    sliding_windows: tuple[int | None, ...]
    rope_keys: tuple[str, ...]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. Norm weights are in the compute dtype (Gemma's `1 +` folded in).

    `pre` and `post` are the argument tuples of `pre_attention` and `post_attention` in
    fast_llama.py, kept ready so the layer loop does no attribute lookups.
    """

    pre: tuple[torch.Tensor | Projection | None, ...]
    post: tuple[torch.Tensor | Projection | None, ...]


def unsupported_reason(model: Any) -> str | None:
    """Why the fast runner cannot run this model, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    if model_type not in FAST_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(sorted(FAST_MODEL_TYPES))}"
    if getattr(config, "use_bidirectional_attention", False):
        return f"model_type {model_type!r} with bidirectional attention is not supported"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    rope_types = getattr(rotary, "rope_type", "default")
    values = rope_types.values() if isinstance(rope_types, dict) else [rope_types]
    if any(value in _DYNAMIC_ROPE_TYPES for value in values):
        return f"model_type {model_type!r} uses a length-dependent rope type ({rope_types})"
    return None


def read_spec(model: Any) -> ArchSpec:
    config = model.config
    family = FAST_MODEL_TYPES[config.model_type]
    attn = model.model.layers[0].self_attn
    num_layers = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":  # every layer slides when the config sets a window
        windows = [window] * num_layers
    else:
        windows = [window if kind == "sliding_attention" else None for kind in layer_types]
    gemma = family == "gemma3"
    activation = "gelu_tanh" if gemma else str(config.hidden_act)
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"model_type {config.model_type!r}: activation {activation!r} is not supported")
    return ArchSpec(
        model_type=config.model_type,
        family=family,
        num_layers=num_layers,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(attn.head_dim),
        attention_scale=float(attn.scaling),
        rms_norm_eps=float(config.rms_norm_eps),
        activation=activation,
        embed_scale=float(config.hidden_size) ** 0.5 if gemma else None,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        sliding_windows=tuple(windows),
        rope_keys=tuple(layer_types) if gemma else ("default",) * num_layers,
    )


def rope_sources(model: Any, spec: ArchSpec) -> dict[str, tuple[torch.Tensor, float]]:
    """rope key -> (inv_freq, attention_scaling), taken from the model's rotary module."""
    rotary = model.model.rotary_emb
    if spec.family == "gemma3":
        return {key: (getattr(rotary, f"{key}_inv_freq"), float(getattr(rotary, f"{key}_attention_scaling")))
                for key in set(spec.rope_keys)}
    return {"default": (rotary.inv_freq, float(rotary.attention_scaling))}


def norm_weight(module: Any, family: str, dtype: torch.dtype) -> torch.Tensor:
    weight = module.weight.detach().float()
    return ((weight + 1.0) if family == "gemma3" else weight).to(dtype).contiguous()


def _is_dense(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def fuse(modules: list[Any], dtype: torch.dtype) -> tuple[Projection, torch.Tensor | None]:
    """Fuse linears along their outputs: (weight `[sum(out), in]` or modules, bias or None)."""
    if not all(_is_dense(m) for m in modules):
        return tuple(modules), None
    weights = [m.weight.detach() for m in modules]
    fused = torch.cat(weights, dim=0).to(dtype).contiguous()
    if all(w.dtype == dtype for w in weights):  # share storage: no second copy of the weights
        start = 0
        for module, weight in zip(modules, weights, strict=True):
            module.weight.data = fused[start : start + weight.shape[0]]
            start += weight.shape[0]
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return fused, None
    parts = [b.detach() if b is not None else torch.zeros(m.weight.shape[0])
             for m, b in zip(modules, biases, strict=True)]
    return fused, torch.cat(parts).to(dtype).contiguous()


def read_layer(layer: Any, spec: ArchSpec, dtype: torch.dtype) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = fuse([attn.q_proj, attn.k_proj, attn.v_proj], dtype)
    o_proj, o_bias = fuse([attn.o_proj], dtype)
    gate_up, gate_up_bias = fuse([mlp.gate_proj, mlp.up_proj], dtype)
    down, down_bias = fuse([mlp.down_proj], dtype)
    gemma = spec.family == "gemma3"

    def norm(module: Any) -> torch.Tensor | None:
        return None if module is None else norm_weight(module, spec.family, dtype)

    pre = (norm(layer.input_layernorm), qkv, qkv_bias,
           norm(attn.q_norm) if gemma else None, norm(attn.k_norm) if gemma else None)
    # Llama normalizes the MLP input with `post_attention_layernorm`; Gemma 3 uses that name
    # for the norm of the attention output and has two more norms around the MLP.
    attn_out_norm = norm(layer.post_attention_layernorm) if gemma else None
    mlp_in_norm = norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm)
    mlp_out_norm = norm(layer.post_feedforward_layernorm) if gemma else None
    post = (o_proj, o_bias, attn_out_norm, mlp_in_norm, gate_up, gate_up_bias, down, down_bias, mlp_out_norm)
    return LayerWeights(pre=pre, post=post)
