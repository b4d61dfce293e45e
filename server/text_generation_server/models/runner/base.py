"""The runner interface: one forward pass of a decoder-only model over a left-padded batch.

Every runner (the fast Llama/Gemma runner, the transformers fallback) takes the same inputs
and updates the same `KVCache`, so that the batch code never knows which one runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from .kv_cache import KVCache


class Runner(Protocol):
    """A model forward over a left-padded batch with a dense KV cache."""

    name: str  # reported in Info and logs, e.g. "fast-llama" or "transformers"
    cpu_kernels: str  # the CPU kernel variant in use (Info), e.g. "avx2"; "none" for torch's ops
    num_layers: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    def new_cache(self, num_rows: int) -> KVCache:
        """An empty cache for num_rows rows."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [rows, new] int64
        position_ids: torch.Tensor,  # [rows, new] int64
        attention_mask: torch.Tensor,  # [rows, cache.length + new]; 1 = real token, 0 = padding
        cache: KVCache,
        last_only: bool = True,
        skip_layers: frozenset[int] = frozenset(),
        bypass_biases: Mapping[int, torch.Tensor] | None = None,
        head: torch.Tensor | None = None,
        draft: bool = False,
    ) -> torch.Tensor:
        """Run the new tokens, append their keys/values to `cache` and advance it.

        Args:
            last_only: return logits of the last position only (`[rows, 1, vocab]`), else of
                every new position (`[rows, new, vocab]`).
            skip_layers: decoder layer indices to bypass (their cache entries stay None).
            bypass_biases: graceful bypass: a skipped layer with an entry adds it (`[hidden]`,
                the layer's mean residual update) instead of passing the hidden state through.
            head: `[n, hidden]` rows of the lm_head to compute instead of the whole head (a
                verified-mode draft's reduced vocabulary); the logits then have n columns.
            draft: a verified-mode draft forward: a runner that keeps cheaper draft weights (the
                fast runner's int8 copy of a dense model's layers and draft head) runs on them.
        Returns:
            float32 logits.
        """
        ...
