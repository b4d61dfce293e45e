"""Waiting requests and the choice of the next batch under the token budgets (docs/tgi-interface.md §1.5).

Budget design note: with `requires_padding` the shard pads every prompt of a batch to the
longest one, so a batch of n requests costs `n * max_input_len` prefill tokens and
`n * max_input_len + sum(max_new_tokens) + speculate` tokens in total. A paged shard is
served as upstream v3 serves it: each request must get its KV blocks from the
`BlockAllocator` (the total budget, in blocks), and costs the prefill budget only for the
prompt tokens not cached; with chunking, the last request that does not fit whole is sent
with the budget left as its `chunk_len`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from text_generation_router.engine.block_allocator import Allocation, BlockAllocator
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
    allocation: Allocation | None = None  # its KV blocks (a paged shard), until it ends
    chunk_len: int | None = None  # its first prefill chunk, when its prompt did not fit the budget
    prefilled: bool = False  # the shard has run its prompt (a generation came back)

    def fail(self, kind: str, message: str) -> None:
        """End this request alone with an error event (see ErrorEvent for the kinds)."""
        if not self.done:
            self.done = True
            self.events.put_nowait(ErrorEvent(kind, message))


@dataclass(frozen=True)
class Budget:
    """Limits for one new batch."""

    prefill_tokens: int
    total_tokens: int  # a padded shard's; a paged shard's total is its free KV blocks
    max_size: int | None
    block_size: int = 1
    speculate: int = 0
    chunking: bool = False  # a prompt may be sent in part (support_chunking)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def count_admissible(sizes: list[tuple[int, int]], budget: Budget) -> int:
    """How many requests, in order, fit a padded shard's budget.

    Args:
        sizes: (input_length, max_new_tokens) of the waiting requests, oldest first.
    Returns:
        The length of the longest admissible prefix.
    """
    max_input = 0
    decode = 0
    for n, (input_length, max_new) in enumerate(sizes):
        if budget.max_size is not None and n >= budget.max_size:
            return n
        max_input = max(max_input, input_length)
        prefill = (n + 1) * max_input
        decode += max_new
        if prefill > budget.prefill_tokens or prefill + decode + budget.speculate > budget.total_tokens:
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

    def next_batch(self, min_size: int | None, budget: Budget,
                   blocks: BlockAllocator | None = None) -> list[Entry] | None:
        """Pop the oldest live entries that fit (and their KV `blocks`, for a paged shard); None
        if fewer than min_size (or none) fit."""
        self._entries = deque(e for e in self._entries if not e.dropped)
        if blocks is not None:
            taken = self._take_paged(budget, blocks)
        else:
            sizes = [(e.request.input_length, e.request.max_new_tokens) for e in self._entries]
            taken = [self._entries.popleft() for _ in range(count_admissible(sizes, budget))]
        if not taken or (min_size is not None and len(taken) < min_size):
            for entry in reversed(taken):  # back at the front, in order, their blocks unpublished
                release_blocks(entry, blocks)
                entry.chunk_len = None
                self._entries.appendleft(entry)
            return None
        now = time.monotonic()
        for entry in taken:
            entry.batched_at = now
        return taken

    def _take_paged(self, budget: Budget, blocks: BlockAllocator) -> list[Entry]:
        """Entries in order while their blocks can be allocated and their uncached prompt tokens
        fit the prefill budget (rounded up to whole blocks, as upstream)."""
        limit = _round_up(budget.prefill_tokens, budget.block_size)
        taken: list[Entry] = []
        prefill = 0
        while self._entries and (budget.max_size is None or len(taken) < budget.max_size):
            entry = self._entries[0]
            r = entry.request
            prompt = None if r.decoder_input_details or not r.input_ids else list(r.input_ids)
            tokens = r.input_length + r.max_new_tokens + budget.speculate - 1
            if tokens > blocks.capacity:  # it would wait forever
                self._entries.popleft().fail("validation", f"{tokens} tokens of KV cache needed (prompt, "
                                             f"new tokens and speculation) exceed the server's {blocks.capacity}")
                continue
            allocation = blocks.allocate(tokens, prompt)
            if allocation is None:
                break
            rest = r.input_length - allocation.prefix_len
            if prefill + rest > limit:
                room = limit - prefill
                if not budget.chunking or room <= 0:
                    blocks.free_allocation(allocation, prefilled=False)
                    break
                entry.chunk_len = room
            entry.allocation = allocation
            taken.append(self._entries.popleft())
            prefill += rest
            if entry.chunk_len is not None:
                break
        return taken


def release_blocks(entry: Entry, blocks: BlockAllocator | None) -> None:
    """Give an entry's KV blocks back (once), its prompt's into the prefix trie if it was prefilled."""
    if blocks is not None and entry.allocation is not None:
        blocks.free_allocation(entry.allocation, entry.prefilled)
    entry.allocation = None
