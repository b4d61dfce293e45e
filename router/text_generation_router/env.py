"""Environment variables the router process reads: read once at startup, here alone.

The launcher's own variables are the SCREAMING_SNAKE equivalents of its flags
(launcher_args.py); this is what the router (`text-generation-router`) reads besides its flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_COMPUTE_TYPE = "gpu+optimized"


@dataclass(frozen=True)
class RouterEnv:
    """Attributes:
    compute_type: COMPUTE_TYPE, answered in the x-compute-type header (upstream's default
        when unset; the launcher sets `1-cpu` for CPU shards).
    """

    compute_type: str = DEFAULT_COMPUTE_TYPE

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> RouterEnv:
        return cls(compute_type=environ.get("COMPUTE_TYPE", DEFAULT_COMPUTE_TYPE))
