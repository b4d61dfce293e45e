"""Environment variables the shard reads, in one typed place (read when serving starts).

Upstream's launcher always sets ATTENTION and PREFIX_CACHING; this backend accepts them (a
padded backend has no paged attention, so they only shape the Info answer) and defaults them
when started by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .watermark import DEFAULT_DELTA, DEFAULT_GAMMA, WatermarkConfig

BLOCK_SIZES = {"paged": 16, "flashdecoding": 256, "flashinfer": 1, "flashdecoding-ipex": 64}


@dataclass(frozen=True)
class ShardEnv:
    attention: str
    prefix_caching: bool
    rank: int
    world_size: int
    watermark: WatermarkConfig = field(default_factory=WatermarkConfig)  # WATERMARK_GAMMA / WATERMARK_DELTA

    @classmethod
    def read(cls) -> ShardEnv:
        attention = os.environ.get("ATTENTION", "paged")
        if attention not in BLOCK_SIZES:
            raise ValueError(f"ATTENTION={attention!r} is not one of {', '.join(BLOCK_SIZES)}")
        prefix = os.environ.get("PREFIX_CACHING", "0").lower() in ("1", "true")
        watermark = WatermarkConfig(_float("WATERMARK_GAMMA", DEFAULT_GAMMA), _float("WATERMARK_DELTA", DEFAULT_DELTA))
        return cls(attention, prefix, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                   watermark)

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.attention]


def _float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return float(value)
    except ValueError as err:
        raise ValueError(f"{name}={value!r} is not a number") from err
