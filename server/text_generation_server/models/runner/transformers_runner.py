"""Fallback runner: transformers' own modules for any causal LM architecture.

The batch keeps its KV cache in our `KVCache` layout; for each forward this runner hands
transformers a `DynamicCache` built from views of it and copies the new columns back.
That costs one copy of the cache per step, which is why architectures with a fast runner
use that one instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import DynamicCache, PreTrainedModel

from .kv_cache import KVCache


class TransformersRunner:
    """Runs `model(...)` of a transformers causal LM (see module docstring)."""

    name = "transformers"

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        text_config = model.config.get_text_config()
        self.num_layers = int(text_config.num_hidden_layers)
        self.cpu_kernels = "none"  # transformers' own modules
        self.vocab_size = int(text_config.vocab_size)
        self.dtype = model.dtype
        self.device = model.device

    def new_cache(self, num_rows: int) -> KVCache:
        return KVCache(num_rows=num_rows, num_layers=self.num_layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        last_only: bool = True,
        skip_layers: frozenset[int] = frozenset(),
        bypass_biases: Mapping[int, torch.Tensor] | None = None,
        head: torch.Tensor | None = None,
        draft: bool = False,  # no draft weights here: a draft runs the model's own
    ) -> torch.Tensor:
        if head is not None:
            raise ValueError("the transformers fallback runner has no reduced draft head; use the fast runner")
        if skip_layers:
            raise ValueError(
                f"the transformers fallback runner cannot skip layers {sorted(skip_layers)}; "
                f"use the fast runner (--runner fast) for layer skipping"
            )
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(self.num_layers if cache.length else 0):
            layer = cache.layer(i)
            assert layer is not None, f"layer {i} has no cache; the fallback runner never skips layers"
            past.append(layer)
        dynamic = DynamicCache(ddp_cache_data=past, config=self.config) if past else DynamicCache(config=self.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=dynamic,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        start = cache.length
        for i, layer in enumerate(out.past_key_values.layers):
            cache.append(i, layer.keys[:, :, start:], layer.values[:, :, start:])
        cache.advance(input_ids.shape[1])
        return out.logits.float()
