"""Fallback runner: transformers' own modules for any causal LM architecture.

The batch keeps its KV cache in our `KVCache` layout; for each forward this runner hands
transformers a `DynamicCache` built from views of it and copies the new columns back.
That costs one copy of the cache per step, which is why architectures with a fast runner
use that one instead.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from ..loading import read_deferred_tables
from .base import ForwardInputs, LayerPath, Runner
from .kv_cache import KVCache


class TransformersRunner(Runner):
    """Runs `model(...)` of a transformers causal LM (see module docstring)."""

    name = "transformers"

    def __init__(self, model: PreTrainedModel) -> None:
        read_deferred_tables(model)  # its modules read their own tables
        self.model = model
        self.config = model.config
        text_config = model.config.get_text_config()
        self.num_layers = int(text_config.num_hidden_layers)
        self.cpu_kernels = "none"  # transformers' own modules
        self.vocab_size = int(text_config.vocab_size)
        self.dtype = model.dtype
        self.device = model.device

    @torch.inference_mode()
    def run(self, inputs: ForwardInputs, cache: KVCache, path: LayerPath) -> torch.Tensor:
        # no draft weights here: a draft runs the model's own
        if path.head is not None:
            raise ValueError("the transformers fallback runner has no reduced draft head; use the fast runner")
        if path.skip:
            raise ValueError(
                f"the transformers fallback runner cannot skip layers {sorted(path.skip)}; "
                f"use the fast runner (--runner fast) for layer skipping"
            )
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(self.num_layers if cache.length else 0):
            layer = cache.layer(i)
            assert layer is not None, f"layer {i} has no cache; the fallback runner never skips layers"
            past.append(layer)
        dynamic = DynamicCache(ddp_cache_data=past, config=self.config) if past else DynamicCache(config=self.config)
        out = self.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            past_key_values=dynamic,
            use_cache=True,
            logits_to_keep=1 if inputs.last_only else 0,
        )
        start = cache.length
        for i, layer in enumerate(out.past_key_values.layers):
            cache.append(i, layer.keys[:, :, start:], layer.values[:, :, start:])
        cache.advance(inputs.input_ids.shape[1])
        return out.logits.float()
