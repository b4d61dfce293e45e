"""Factories for the layerskip tests: tiny random models of several families, real models."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.models.loading import LoadConfig, load_model

# name -> (load config) of every copy of the default model the fingerprint tests compare.
QUANTIZATIONS: dict[str, LoadConfig] = {
    "float32": LoadConfig(),
    "bfloat16": LoadConfig(dtype="bfloat16"),
    "int8": LoadConfig(quantize="bitsandbytes"),
    "nf4": LoadConfig(quantize="bitsandbytes-nf4"),
    "fp4": LoadConfig(quantize="bitsandbytes-fp4"),
}


def tiny_config(family: str, num_layers: int = 4) -> PretrainedConfig:
    """A config of `family` small enough to build in milliseconds."""
    if family == "llama":
        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "gpt2":
        return GPT2Config(vocab_size=128, n_embd=64, n_layer=num_layers, n_head=4, n_positions=128,
                          bos_token_id=0, eos_token_id=0)
    if family == "opt":
        return OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=128)
    if family == "gemma3":
        return Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16)
    raise ValueError(f"unknown family {family!r}")


def tiny_model(family: str = "llama", seed: int = 0, num_layers: int = 4) -> PreTrainedModel:
    """A random-weight causal LM; norm weights are randomized too so every tensor is informative."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_layers))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


class PeftStyleWrapper(nn.Module):
    """Mimics a PEFT model: the causal LM sits at `base_model.model`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = model


class RenamedBlocks(nn.Module):
    """Keeps a model's decoder layers under an arbitrary attribute name, next to a longer list."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.trunk = nn.Module()
        self.trunk.stack_of_blocks = layers
        self.probes = nn.ModuleList(nn.Linear(2, 2) for _ in range(3 * len(layers)))


def real_model(name: str) -> PreTrainedModel:
    """The default model loaded with plain transformers in one of QUANTIZATIONS."""
    return load_model(real_model_path(), QUANTIZATIONS[name])


def real_model_path() -> Path:
    return download_weights(DEFAULT_MODEL_ID)
