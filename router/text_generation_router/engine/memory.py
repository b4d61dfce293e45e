"""Giving memory back after a burst.

A burst of large bodies (500 KB prompts tokenized to be truncated, thousands of chat messages
rendered) leaves glibc's heaps holding freed pages, and the router's RSS stays at its peak long
after. `malloc_trim(0)` returns the free pages of every arena to the system; it runs when no
request is in flight and some were admitted since the last trim, at most every TRIM_EVERY_S.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

from text_generation_router.engine.infer import Infer

TRIM_EVERY_S = 5.0


def _malloc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return None if trim is None else (lambda: trim(0))


async def trim_after_bursts(infer: Infer, interval_s: float = TRIM_EVERY_S) -> None:
    """Forever: every `interval_s`, trim once when no request is in flight and some were
    admitted since the last trim."""
    trim = _malloc_trim()
    if trim is None:
        return
    trimmed_at = 0
    while True:
        await asyncio.sleep(interval_s)
        if infer.in_flight == 0 and infer.admitted != trimmed_at:
            trim()
            trimmed_at = infer.admitted
