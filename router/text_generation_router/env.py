"""Environment variables the router and the launcher read: read once at startup, here alone.

RouterEnv is what the router (`text-generation-router`) reads besides its flags. LauncherEnv
is the launcher's environment: its flags' defaults come from their SCREAMING_SNAKE
equivalents (launcher_args.py), and its children inherit it (launcher.child_env).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

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


@dataclass(frozen=True)
class LauncherEnv:
    """A copy of the launcher's environment taken once, with the typed reads its flags need.

    An empty number counts as unset; a bad one raises a ValueError naming the variable and its
    value, which the launcher prints before it exits 2.
    """

    environ: Mapping[str, str]

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> LauncherEnv:
        return cls(dict(environ))

    def text(self, name: str, default: str | None) -> str | None:
        return self.environ.get(name, default)

    def integer(self, name: str, default: int | None) -> int | None:
        return self._parsed(name, int, "an integer", default)

    def number(self, name: str, default: float | None = None) -> float | None:
        return self._parsed(name, float, "a number", default)

    def _parsed(self, name: str, parse: Callable[[str], T], kind: str, default: T | None) -> T | None:
        value = self.environ.get(name)
        if value in (None, ""):
            return default
        try:
            return parse(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not {kind}") from None

    def flag(self, name: str) -> bool:
        return self.environ.get(name, "").lower() in ("1", "true", "yes", "on")

    def hostname(self) -> str:
        """HOSTNAME is usually the machine's name, not an address: upstream falls back then."""
        value = self.environ.get("HOSTNAME", "")
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return "0.0.0.0"
        return value
