"""The router's KV block accounting for a paged shard: blocks and slots, prefix matching over
full blocks, what enters the trie and when, eviction, and the paged queue's budgets."""

from __future__ import annotations

import asyncio

from text_generation_router.engine.block_allocator import BlockAllocator
from text_generation_router.engine.events import ErrorEvent
from text_generation_router.engine.queue import Budget, Entry, Queue, release_blocks
from text_generation_router.engine.validation import ChooserParameters, ValidRequest

BS = 16


def prompt(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_blocks_and_slots_cover_the_tokens_and_never_block_zero() -> None:
    blocks = BlockAllocator(32, BS, prefix_caching=True)
    a = blocks.allocate(100, prompt(0, 40))
    assert a is not None and a.prefix_len == 0
    assert len(a.blocks) == 7 and 0 not in a.blocks and len(set(a.blocks)) == 7
    assert a.slots == [b * BS + i for b in a.blocks for i in range(BS)][:100]
    assert (blocks.used, blocks.cached, len(blocks.free)) == (7, 0, 24)


def test_a_prefilled_prompts_full_blocks_are_reused_by_the_next() -> None:
    blocks = BlockAllocator(32, BS, prefix_caching=True)
    first = blocks.allocate(60, prompt(0, 40))
    assert first is not None
    blocks.free_allocation(first, prefilled=True)
    assert (blocks.used, blocks.cached) == (0, 2)  # 40 tokens: two full blocks, the partial one goes back
    second = blocks.allocate(70, prompt(0, 40) + [999] * 10)
    assert second is not None and second.prefix_len == 32 and second.blocks[:2] == first.blocks[:2]
    # diverging inside the second block: only the first matches
    third = blocks.allocate(30, prompt(0, 20) + [7] * 20)
    assert third is not None and third.prefix_len == 16 and third.blocks[0] == first.blocks[0]
    # a prompt wholly cached still runs its last token
    whole = blocks.allocate(40, prompt(0, 32))
    assert whole is not None and whole.prefix_len == 31 and whole.blocks[:2] == first.blocks[:2]


def test_only_a_prefilled_prompt_is_published_and_caching_can_be_off() -> None:
    blocks = BlockAllocator(32, BS, prefix_caching=True)
    a = blocks.allocate(60, prompt(0, 40))
    assert a is not None
    blocks.free_allocation(a, prefilled=False)  # put back in the queue, or failed before its prefill
    assert (blocks.used, blocks.cached, len(blocks.free)) == (0, 0, 31)
    off = BlockAllocator(32, BS, prefix_caching=False)
    b = off.allocate(60, prompt(0, 40))
    assert b is not None
    off.free_allocation(b, prefilled=True)
    c = off.allocate(60, prompt(0, 40))
    assert c is not None and c.prefix_len == 0 and off.cached == 0


def test_two_runs_of_one_prompt_cache_it_once_and_lose_no_block() -> None:
    blocks = BlockAllocator(32, BS, prefix_caching=True)
    a, b = blocks.allocate(50, prompt(0, 48)), blocks.allocate(50, prompt(0, 48))
    assert a is not None and b is not None and not set(a.blocks) & set(b.blocks)
    blocks.free_allocation(a, prefilled=True)
    blocks.free_allocation(b, prefilled=True)  # its copies of the three blocks are duplicates: freed
    assert (blocks.cached, len(blocks.free)) == (3, 28)


def test_eviction_takes_unheld_least_recently_used_leaves_and_spares_held_ones() -> None:
    blocks = BlockAllocator(9, BS, prefix_caching=True)  # 8 usable blocks
    for first in (0, 1000):  # two cached prompts of 2 blocks each, the first older
        a = blocks.allocate(32, prompt(first, 32))
        assert a is not None
        blocks.free_allocation(a, prefilled=True)
    assert (blocks.cached, len(blocks.free)) == (4, 4)
    held = blocks.allocate(48, prompt(1000, 32) + [5] * 16)  # holds the newer prompt's 2 blocks, takes 1
    assert held is not None and held.prefix_len == 32
    big = blocks.allocate(80, None)  # 5 blocks: 3 free, then the older prompt's two (leaf first)
    assert big is not None and blocks.cached == 2 and len(blocks.free) == 0
    assert blocks.allocate(16, None) is None  # the held prefix is never evicted
    assert blocks.allocate(48, prompt(1000, 32)) is None and all(n.holders == 1 for n in held.path)
    blocks.free_allocation(big, prefilled=False)
    blocks.free_allocation(held, prefilled=True)
    assert blocks.used == 0 and blocks.cached + len(blocks.free) == 8


def entry(n: int, ids: list[int], max_new: int = 10) -> Entry:
    greedy = ChooserParameters(1.0, 0, 1.0, 1.0, False, 0, 1.0, 0.0, False)
    request = ValidRequest(inputs="x", input_length=len(ids), truncate=len(ids), add_special_tokens=True,
                           parameters=greedy, max_new_tokens=max_new, input_ids=tuple(ids))
    return Entry(id=n, request=request, events=asyncio.Queue())


def test_paged_queue_counts_uncached_tokens_and_chunks_the_last_prompt() -> None:
    blocks = BlockAllocator(64, BS, prefix_caching=True)
    cached = blocks.allocate(70, prompt(0, 64))
    assert cached is not None
    blocks.free_allocation(cached, prefilled=True)
    queue = Queue()
    for n, ids in enumerate((prompt(0, 64) + [1] * 10, prompt(500, 40), prompt(900, 40))):
        queue._entries.append(entry(n, ids))
    budget = Budget(prefill_tokens=80, total_tokens=0, max_size=None, block_size=BS, speculate=2)
    assert [e.id for e in queue.next_batch(None, budget, blocks) or []] == [0, 1]  # 10 + 40 of 80; 40 more do not fit
    chunking = Budget(prefill_tokens=80, total_tokens=0, max_size=None, block_size=BS, chunking=True)
    taken = queue.next_batch(None, chunking, blocks) or []
    assert [(e.id, e.chunk_len) for e in taken] == [(2, None)]
    queue._entries.append(entry(3, prompt(2000, 100)))
    taken = queue.next_batch(None, chunking, blocks) or []
    assert [(e.id, e.chunk_len) for e in taken] == [(3, 80)]  # its first 80 tokens, the rest in the shard's steps
    free = len(blocks.free)
    queue._entries.extend([entry(4, prompt(3000, 20)), entry(5, prompt(4000, 20))])
    assert queue.next_batch(3, chunking, blocks) is None  # fewer than min_size: back, blocks given back
    assert len(blocks.free) == free and [e.id for e in queue._entries] == [4, 5]
    assert all(e.allocation is None for e in queue._entries)
    held = len(blocks.free)
    for e in taken:
        release_blocks(e, blocks)
    assert len(blocks.free) > held and taken[0].allocation is None


def test_a_request_larger_than_the_whole_cache_fails_alone_instead_of_waiting() -> None:
    blocks = BlockAllocator(5, BS, prefix_caching=True)  # 4 usable blocks: 64 tokens
    queue = Queue()
    big = entry(0, prompt(0, 60), max_new=10)
    queue._entries.extend([big, entry(1, prompt(100, 20))])
    budget = Budget(prefill_tokens=1000, total_tokens=0, max_size=None, block_size=BS)
    assert [e.id for e in queue.next_batch(None, budget, blocks) or []] == [1]
    assert len(queue) == 0 and big.done
    error = big.events.get_nowait()
    assert isinstance(error, ErrorEvent) and "69 tokens" in error.message and "64" in error.message
