"""Waiting requests and the choice of the next batch under the token budgets (docs/tgi-interface.md §1.5).

Budget design note: with `requires_padding` the shard pads every prompt of a batch to the
longest one, so a batch of n requests costs `n * max_input_len` prefill tokens and
`n * max_input_len + sum(max_new_tokens) + speculate` tokens in total. Block-based shards
are estimated per request, rounded up to whole blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from text_generation_router.engine.events import ErrorEvent, InferEvent, LayerSkipReport
from text_generation_router.engine.validation import ValidRequest


@dataclass
class Entry:
    """One request between the HTTP handler and the batcher."""

    id: int
    request: ValidRequest
    events: asyncio.Queue[InferEvent]
    queued_at: float = field(default_factory=time.monotonic)
    batched_at: float | None = None
    # Set by the HTTP side when its client went away; the batcher drops it at the next step.
    dropped: bool = False
    # Set by the batcher once the request has its last event (last token or error).
    done: bool = False
    layer_skip: LayerSkipReport | None = None
    cached_tokens: int = 0  # prompt tokens the shard took from its prefix cache

    def fail(self, kind: str, message: str) -> None:
        """End this request alone with an error event (see ErrorEvent for the kinds)."""
        if not self.done:
            self.done = True
            self.events.put_nowait(ErrorEvent(kind, message))


@dataclass(frozen=True)
class Budget:
    """Limits for one new batch."""

    prefill_tokens: int
    total_tokens: int
    max_size: int | None
    requires_padding: bool = True
    block_size: int = 1
    speculate: int = 0


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def count_admissible(sizes: list[tuple[int, int]], budget: Budget) -> int:
    """How many requests, in order, fit the budget.

    Args:
        sizes: (input_length, max_new_tokens) of the waiting requests, oldest first.
    Returns:
        The length of the longest admissible prefix.
    """
    max_input = 0
    prefill = 0
    decode = 0
    for n, (input_length, max_new) in enumerate(sizes):
        if budget.max_size is not None and n >= budget.max_size:
            return n
        if budget.requires_padding:
            max_input = max(max_input, input_length)
            prefill = (n + 1) * max_input
            decode += max_new
        else:
            prefill += _round_up(input_length, budget.block_size)
            decode += _round_up(max_new + budget.speculate, budget.block_size)
        total = prefill + decode + (budget.speculate if budget.requires_padding else 0)
        if prefill > budget.prefill_tokens or total > budget.total_tokens:
            return n
    return len(sizes)


class Queue:
    """FIFO of entries; `next_batch` takes the oldest ones that fit a budget."""

    def __init__(self) -> None:
        self._entries: deque[Entry] = deque()
        self._next_id = 0
        self.notify = asyncio.Event()

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, request: ValidRequest) -> Entry:
        entry = Entry(id=self._next_id, request=request, events=asyncio.Queue())
        self._next_id += 1
        self._entries.append(entry)
        self.notify.set()
        return entry

    def fail_all(self, kind: str, message: str) -> None:
        """End every waiting request with an error (graceful termination deadline)."""
        while self._entries:
            self._entries.popleft().fail(kind, message)

    def next_batch(self, min_size: int | None, budget: Budget) -> list[Entry] | None:
        """Pop the oldest live entries that fit; None if fewer than min_size (or none) fit."""
        self._entries = deque(e for e in self._entries if not e.dropped)
        candidates = list(self._entries)
        sizes = [(e.request.input_length, e.request.max_new_tokens) for e in candidates]
        count = count_admissible(sizes, budget)
        if count == 0 or (min_size is not None and count < min_size):
            return None
        now = time.monotonic()
        taken = [self._entries.popleft() for _ in range(count)]
        for entry in taken:
            entry.batched_at = now
        return taken
