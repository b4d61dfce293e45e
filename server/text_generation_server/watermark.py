"""Watermarking (Kirchenbauer et al., 2023, "A Watermark for Large Language Models"), as
upstream TGI applies it, and the matching detector.

Design note. Before each token is chosen, a pseudo-random "green list" of
`int(gamma * vocab)` token ids is drawn from a generator seeded with
`HASH_KEY * previous token id`, and `delta` is added to the green tokens' logits. Text
written this way holds far more green tokens than chance (a fraction gamma), which a
detector that knows only the key can test with a one-proportion z-test, without the model.
The seeding, the permutation (`torch.randperm` on a CPU generator) and the defaults are
upstream's, so upstream's detectors and ours agree on text from either server.
Processing order (upstream's): watermark first, then penalties, grammar, warpers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HASH_KEY = 15485863  # the one-millionth prime, upstream's key
DEFAULT_GAMMA = 0.5
DEFAULT_DELTA = 2.0


@dataclass(frozen=True)
class WatermarkConfig:
    """Server-wide watermark strength (env WATERMARK_GAMMA / WATERMARK_DELTA, as upstream's launcher sets).

    Attributes:
        gamma: the green list's share of the vocabulary, in (0, 1).
        delta: what a green token's logit gains (> 0).
    """

    gamma: float = DEFAULT_GAMMA
    delta: float = DEFAULT_DELTA

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"--watermark-gamma {self.gamma} must be in (0, 1)")
        if not self.delta > 0.0:
            raise ValueError(f"--watermark-delta {self.delta} must be positive")


def green_list(previous_token: int, vocab_size: int, gamma: float) -> torch.Tensor:
    """The green token ids that follow `previous_token` (int64, `[int(gamma * vocab_size)]`)."""
    generator = torch.Generator()
    generator.manual_seed(HASH_KEY * previous_token)
    return torch.randperm(vocab_size, generator=generator)[: int(gamma * vocab_size)]


def apply_watermark(logits: torch.Tensor, previous_token: int, config: WatermarkConfig) -> torch.Tensor:
    """Add delta to the green tokens of one row of logits `[vocab]`, in place."""
    logits[green_list(previous_token, logits.shape[-1], config.gamma)] += config.delta
    return logits


@dataclass(frozen=True)
class Detection:
    """The detector's verdict on a token sequence."""

    num_scored: int  # tokens scored (all but the first)
    num_green: int
    z_score: float  # standard deviations above the green count chance gives

    def is_watermarked(self, threshold: float = 4.0) -> bool:
        return self.z_score >= threshold


def detect(token_ids: Sequence[int], vocab_size: int, gamma: float = DEFAULT_GAMMA) -> Detection:
    """Count the tokens that are green given the token before them and test against chance."""
    scored = len(token_ids) - 1
    if scored < 1:
        raise ValueError(f"watermark detection needs at least 2 tokens, got {len(token_ids)}")
    green = sum(int(bool((green_list(prev, vocab_size, gamma) == token).any()))
                for prev, token in zip(token_ids, token_ids[1:], strict=False))
    z = (green - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))
    return Detection(scored, green, z)
