"""Detector: fixed, untrained filters over a prompt's input embeddings.

Design note. The decider needs a few numbers that say how "surprising" a prompt is, at a cost
far below a prefill. We read only the input embeddings (the embedding lookup, no layer runs):

- each token's embedding is scaled to unit RMS (so dtype and embedding scale do not matter);
- gradient g[t] = ||x[t] - x[t-1]|| / sqrt(hidden): how much the next token differs;
- local variance v[t]: variance over the causal window x[t-window+1..t], averaged over hidden;
- per-position score s[t] = gradient_weight * g[t] + (1 - gradient_weight) * v[t];
- aggregates max_score and mean_score, and prompt-level features: the number of tokens, the
  normalized spectral entropy of the embedding trajectory along the sequence (0: one slow
  trend, 1: white noise) and the excess kurtosis of the per-position scores (a few spikes).

Every prompt is computed alone, on its unpadded slice, in float64 with the same operations, so
the same tokens give bit-identical scores in any batch, with any padding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

FEATURES = ("num_tokens", "max_score", "mean_score", "spectral_entropy", "kurtosis")


@dataclass(frozen=True)
class DetectorConfig:
    """Detector settings (stored in a policy so that calibration and serving agree).

    Attributes:
        window: tokens in the causal window of the local variance.
        gradient_weight: weight of the gradient in the per-position score (variance: 1 - it).
        max_tokens: score only the last `max_tokens` tokens of longer prompts (bounds cost).
    """

    window: int = 4
    gradient_weight: float = 0.5
    max_tokens: int = 2048

    def __post_init__(self) -> None:
        if not 2 <= self.window <= 64:
            raise ValueError(f"detector window={self.window}: use 2..64 tokens")
        if not 0.0 <= self.gradient_weight <= 1.0:
            raise ValueError(f"detector gradient_weight={self.gradient_weight}: use a value in [0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"detector max_tokens={self.max_tokens}: use at least 1")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DetectorScores:
    """What the detector saw in one prompt; the decider's conditions read these fields."""

    num_tokens: int
    max_score: float
    mean_score: float
    spectral_entropy: float
    kurtosis: float

    def as_dict(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in FEATURES}


def _local_variance(x: torch.Tensor, window: int) -> torch.Tensor:
    # x: [seq, hidden]; causal window via cumulative sums of x and x^2.
    seq = x.shape[0]
    zero = torch.zeros(1, x.shape[1], dtype=x.dtype)
    c1 = torch.cat([zero, x.cumsum(0)])  # [seq + 1, hidden]
    c2 = torch.cat([zero, (x * x).cumsum(0)])
    end = torch.arange(1, seq + 1)
    start = (end - window).clamp(min=0)
    count = (end - start).to(x.dtype).unsqueeze(1)  # [seq, 1]
    mean = (c1.index_select(0, end) - c1.index_select(0, start)) / count
    var = (c2.index_select(0, end) - c2.index_select(0, start)) / count - mean * mean
    return var.clamp(min=0.0).mean(dim=1)  # [seq]


def _spectral_entropy(x: torch.Tensor) -> float:
    seq = x.shape[0]
    if seq < 4:
        return 0.0
    power = torch.fft.rfft(x - x.mean(dim=0), dim=0).abs().pow(2).sum(dim=1)[1:]  # drop DC
    total = float(power.sum())
    if total <= 0.0 or len(power) < 2:
        return 0.0
    p = power / total
    entropy = -float((p * torch.log(p.clamp(min=1e-300))).sum())
    return entropy / math.log(len(power))


def _kurtosis(s: torch.Tensor) -> float:
    if s.shape[0] < 4:
        return 0.0
    centred = s - s.mean()
    var = float((centred * centred).mean())
    if var <= 1e-24:
        return 0.0
    return float((centred**4).mean()) / (var * var) - 3.0


def detect(embeddings: torch.Tensor, config: DetectorConfig) -> DetectorScores:
    """Scores of one prompt from its valid-token embeddings.

    Args:
        embeddings: [seq, hidden] input embeddings of the prompt's tokens, no padding.
        config: the detector settings.
    """
    if embeddings.dim() != 2:
        raise ValueError(f"detect takes [seq, hidden] embeddings, got shape {tuple(embeddings.shape)}")
    x = embeddings[-config.max_tokens:].detach().to(device="cpu", dtype=torch.float64)
    seq, hidden = x.shape
    if seq == 0:
        return DetectorScores(0, 0.0, 0.0, 0.0, 0.0)
    x = x / x.pow(2).mean(dim=1, keepdim=True).sqrt().clamp(min=1e-12)
    grad = torch.zeros(seq, dtype=torch.float64)
    if seq > 1:
        grad[1:] = (x[1:] - x[:-1]).norm(dim=1) / math.sqrt(hidden)
    var = _local_variance(x, config.window)
    score = config.gradient_weight * grad + (1.0 - config.gradient_weight) * var  # [seq]
    return DetectorScores(num_tokens=int(embeddings.shape[0]), max_score=float(score.max()),
                          mean_score=float(score.mean()), spectral_entropy=_spectral_entropy(x),
                          kurtosis=_kurtosis(score))


def detect_batch(embeddings: torch.Tensor, attention_mask: torch.Tensor,
                 config: DetectorConfig) -> list[DetectorScores]:
    """Scores per row of a padded batch; each row is scored alone on its valid tokens.

    Args:
        embeddings: [batch, seq, hidden].
        attention_mask: [batch, seq], nonzero on valid tokens (left or right padding).
    """
    if embeddings.shape[:2] != attention_mask.shape:
        raise ValueError(f"embeddings {tuple(embeddings.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} disagree on [batch, seq]")
    return [detect(embeddings[row][attention_mask[row].bool()], config)
            for row in range(embeddings.shape[0])]
