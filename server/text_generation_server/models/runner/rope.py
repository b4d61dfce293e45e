"""Rotary position embedding tables, computed once and gathered per forward.

The angles are `position * inv_freq` in float32, exactly as transformers computes them, so
the tables give bit-identical cos/sin. `inv_freq` and the attention scaling come from the
loaded model's own rotary module, which already applied any rope scaling (linear, llama3,
yarn): this file never re-derives them from the config.

Rotation: transformers' `rotate_half(x) = cat(-x2, x1)`. We store `sin` with its first half
negated, so that `rotate_half(x) * sin == x.roll(half) * signed_sin`: one roll instead of
two slices, a negation and a cat in every layer.
"""

from __future__ import annotations

import torch

MIN_POSITIONS = 4096  # rows of the first table; it doubles when a longer position shows up


class RopeTable:
    """cos and signed-sin tables `[positions, head_dim]` in the compute dtype."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq.detach().float().cpu()  # [head_dim / 2]
        self.attention_scaling = float(attention_scaling)
        self.dtype = dtype
        self.cos = torch.empty(0)
        self.sin_signed = torch.empty(0)
        self._build(MIN_POSITIONS)

    def _build(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [positions, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [positions, head_dim]
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        half = sin.shape[-1] // 2
        sin[:, :half] = -sin[:, :half]
        self.cos = cos.to(self.dtype)
        self.sin_signed = sin.to(self.dtype)

    def gather(self, position_ids: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `position_ids` `[rows, new]`, shaped `[rows, new, 1, head_dim]`.

        `max_position` is the largest position in `position_ids`, known to the caller without a
        device sync (cache length + new tokens bounds it).
        """
        if max_position >= self.cos.shape[0]:
            size = self.cos.shape[0]
            while size <= max_position:
                size *= 2
            self._build(size)
        cos = self.cos[position_ids].unsqueeze(2)
        sin = self.sin_signed[position_ids].unsqueeze(2)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[rows, new, heads, head_dim]` (transformers' rotate_half convention)."""
    # Not addcmul: its fused multiply-add rounds differently, and one ulp here grows past the
    # logits' 1e-4 parity budget.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
