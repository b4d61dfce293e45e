"""Environment variables the shard reads, in one typed place (read when serving starts).

Upstream's launcher always sets ATTENTION and PREFIX_CACHING; this backend accepts them (a
padded backend has no paged attention, so they only shape the Info answer) and defaults them
when started by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BLOCK_SIZES = {"paged": 16, "flashdecoding": 256, "flashinfer": 1, "flashdecoding-ipex": 64}


@dataclass(frozen=True)
class ShardEnv:
    attention: str
    prefix_caching: bool
    rank: int
    world_size: int

    @classmethod
    def read(cls) -> ShardEnv:
        attention = os.environ.get("ATTENTION", "paged")
        if attention not in BLOCK_SIZES:
            raise ValueError(f"ATTENTION={attention!r} is not one of {', '.join(BLOCK_SIZES)}")
        prefix = os.environ.get("PREFIX_CACHING", "0").lower() in ("1", "true")
        return cls(attention, prefix, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.attention]
