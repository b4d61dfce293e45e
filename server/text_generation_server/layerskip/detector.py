"""Detector: fixed, untrained filters over a prompt's input embeddings.

Design note. The decider needs a few numbers that say how "surprising" a prompt is, at a cost
far below a prefill. We read only the input embeddings (the embedding lookup, no layer runs):

- each token's embedding is scaled to unit RMS (so dtype and embedding scale do not matter);
- the filters then read a fixed, evenly spaced subset of `num_dims` hidden dimensions: their
  outputs are means over dimensions, which the subset estimates at a fraction of the cost;
- gradient g[t] = RMS over dims of (x[t] - x[t-1]): how much the next token differs;
- local variance v[t]: variance over the causal window x[t-window+1..t], averaged over dims;
- per-position score s[t] = gradient_weight * g[t] + (1 - gradient_weight) * v[t];
- aggregates max_score and mean_score, and prompt-level features: the number of tokens, the
  normalized spectral entropy of the embedding trajectory along the sequence (0: one slow
  trend, 1: white noise) and the excess kurtosis of the per-position scores (a few spikes).

Every prompt is computed alone, on its unpadded slice, in float64 numpy (single-threaded, so
no thread pool is woken and the cost does not depend on the server's torch threads), with the
same operations: the same tokens give bit-identical scores in any batch, with any padding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

FEATURES = ("num_tokens", "max_score", "mean_score", "spectral_entropy", "kurtosis")


@dataclass(frozen=True)
class DetectorConfig:
    """Detector settings (stored in a policy so that calibration and serving agree).

    Attributes:
        window: tokens in the causal window of the local variance.
        gradient_weight: weight of the gradient in the per-position score (variance: 1 - it).
        max_tokens: score only the last `max_tokens` tokens of longer prompts (bounds cost).
        num_dims: hidden dimensions the filters read (evenly spaced; 0 reads all of them).
    """

    window: int = 4
    gradient_weight: float = 0.5
    max_tokens: int = 2048
    num_dims: int = 64

    def __post_init__(self) -> None:
        if not 2 <= self.window <= 64:
            raise ValueError(f"detector window={self.window}: use 2..64 tokens")
        if not 0.0 <= self.gradient_weight <= 1.0:
            raise ValueError(f"detector gradient_weight={self.gradient_weight}: use a value in [0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"detector max_tokens={self.max_tokens}: use at least 1")
        if self.num_dims < 0:
            raise ValueError(f"detector num_dims={self.num_dims}: use 0 (all) or a positive count")

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


def _local_variance(x: np.ndarray, window: int) -> np.ndarray:
    # x: [seq, dims]; causal window via cumulative sums of x and x^2.
    seq, dims = x.shape
    c1 = np.zeros((seq + 1, dims))
    c2 = np.zeros((seq + 1, dims))
    np.cumsum(x, axis=0, out=c1[1:])
    np.cumsum(x * x, axis=0, out=c2[1:])
    end = np.arange(1, seq + 1)
    start = np.maximum(end - window, 0)
    count = (end - start)[:, None]
    mean = (c1[end] - c1[start]) / count
    var = (c2[end] - c2[start]) / count - mean * mean
    result: np.ndarray = np.maximum(var, 0.0).mean(axis=1)  # [seq]
    return result


def _spectral_entropy(x: np.ndarray) -> float:
    if x.shape[0] < 4:
        return 0.0
    power = (np.abs(np.fft.rfft(x - x.mean(axis=0), axis=0)) ** 2).sum(axis=1)[1:]  # drop DC
    total = float(power.sum())
    if total <= 0.0 or len(power) < 2:
        return 0.0
    p = power / total
    entropy = -float((p * np.log(np.maximum(p, 1e-300))).sum())
    return entropy / math.log(len(power))


def _kurtosis(s: np.ndarray) -> float:
    if s.shape[0] < 4:
        return 0.0
    centred = s - s.mean()
    var = float((centred * centred).mean())
    if var <= 1e-24:
        return 0.0
    return float((centred**4).mean()) / (var * var) - 3.0


def _normalized(embeddings: torch.Tensor, config: DetectorConfig) -> np.ndarray:
    x = embeddings[-config.max_tokens:].detach().to("cpu").float().numpy()  # [seq, hidden]
    rms = np.sqrt(np.square(x, dtype=np.float64).mean(axis=1, keepdims=True))
    hidden = x.shape[1]
    if 0 < config.num_dims < hidden:
        x = x[:, np.unique(np.linspace(0, hidden - 1, config.num_dims).round().astype(np.int64))]
    normalized: np.ndarray = x.astype(np.float64) / np.maximum(rms, 1e-12)
    return normalized  # [seq, dims]


def detect(embeddings: torch.Tensor, config: DetectorConfig) -> DetectorScores:
    """Scores of one prompt from its valid-token embeddings.

    Args:
        embeddings: [seq, hidden] input embeddings of the prompt's tokens, no padding.
        config: the detector settings.
    """
    if embeddings.dim() != 2:
        raise ValueError(f"detect takes [seq, hidden] embeddings, got shape {tuple(embeddings.shape)}")
    if embeddings.shape[0] == 0:
        return DetectorScores(0, 0.0, 0.0, 0.0, 0.0)
    x = _normalized(embeddings, config)
    grad = np.zeros(x.shape[0])
    if x.shape[0] > 1:
        step = x[1:] - x[:-1]
        grad[1:] = np.sqrt((step * step).mean(axis=1))
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
