"""KV blocks of a paged shard (Info.requires_padding false), counted by the router as upstream
v3's router counts them, with its prefix matching (docs/tgi-interface.md §1.5).

Every admitted request holds the blocks of `input_length + max_new_tokens + speculate - 1`
tokens (the last token chosen never needs keys and values) until it ends; a request that does
not fit the free blocks waits in the queue. So `--max-batch-total-tokens` is a number of blocks
times the block size, and the request's Prefill carries its `blocks`, its `slots` (the first
that many slots of its blocks) and `cache_len`.

Prefix caching (Info.use_prefix_caching): a trie over full blocks of prompt token ids, one node
per block, remembers the blocks of prompts the shard has run. A new prompt that starts with the
same full blocks holds those nodes (counted) instead of new blocks, and is sent with
`cache_len` = the tokens they cover (one less when they cover the whole prompt: the last
token's logits choose the first new one). A cached node no request holds is evicted, least
recently used leaf first, when free blocks run short. A prompt's full blocks enter the trie when
its request ends, and only if the shard prefilled it (its first token came back): a request that
failed or went back to the queue before its prefill publishes nothing (upstream publishes it,
although those blocks were never written). Generated tokens are not inserted (upstream's rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    """One full block of a cached prompt: its tokens, under its parent's."""

    key: tuple[int, ...]
    block: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    holders: int = 0  # allocations whose prefix runs through this node
    used: int = 0  # the allocator's clock at the last match or insert


@dataclass
class Allocation:
    """A request's blocks: the matched prefix's first (`path`), then its own."""

    blocks: list[int]
    slots: list[int]
    prefix_len: int  # prompt tokens whose KV is cached (the request's cache_len)
    prompt: tuple[int, ...] | None  # matched and inserted; None: prefix caching off for it
    path: list[Node]


class BlockAllocator:
    """Free blocks, and the trie of cached prompt blocks when `prefix_caching` (module docstring).

    Block 0 is never handed out: upstream's router sends it in its health probe."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"{num_blocks} KV blocks of {block_size} tokens are too few to serve")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # popped from the end: lowest ids first
        self.root = Node((), -1, None)
        self.cached = 0  # blocks the trie holds
        self.clock = 0

    @property
    def capacity(self) -> int:
        """The most tokens one allocation can hold."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def used(self) -> int:
        """Blocks held by requests, not counting cached blocks."""
        return self.num_blocks - 1 - len(self.free) - self.cached

    def allocate(self, tokens: int, prompt: list[int] | None) -> Allocation | None:
        """Blocks for `tokens` tokens, the cached full blocks of `prompt` first (None: do not
        match it, for a request that asked for its prompt's logprobs); None if too few are free
        even after evicting unused cached blocks."""
        bs = self.block_size
        key = tuple(prompt) if prompt is not None and self.prefix_caching else None
        path = self._match(key) if key is not None else []
        for node in path:  # held before evicting, so that eviction spares them
            node.holders += 1
        needed = max(0, math.ceil(tokens / bs) - len(path))
        if needed > len(self.free):
            self._evict(needed - len(self.free))
        if needed > len(self.free):
            self._let_go(path)
            return None
        blocks = [n.block for n in path] + [self.free.pop() for _ in range(needed)]
        slots = [b * bs + i for b in blocks for i in range(bs)][:tokens]
        prefix_len = len(path) * bs
        if key is not None and prefix_len >= len(key):
            prefix_len = len(key) - 1
        return Allocation(blocks, slots, prefix_len, key, path)

    def free_allocation(self, allocation: Allocation, prefilled: bool) -> None:
        """A request ended: its blocks go back, its prompt's full blocks into the trie if the
        shard `prefilled` it."""
        self._let_go(allocation.path)
        blocks, kept = allocation.blocks, set()
        if allocation.prompt is not None and prefilled:
            kept = self._insert(allocation.prompt, allocation.path, blocks)
        self.free.extend(reversed([b for b in blocks[len(allocation.path):] if b not in kept]))

    def _match(self, key: tuple[int, ...]) -> list[Node]:
        bs, node, path = self.block_size, self.root, []
        self.clock += 1
        for start in range(0, len(key) - bs + 1, bs):
            child = node.children.get(key[start:start + bs])
            if child is None:
                break
            child.used = self.clock
            path.append(child)
            node = child
        return path

    def _insert(self, key: tuple[int, ...], path: list[Node], blocks: list[int]) -> set[int]:
        """Add `key`'s full blocks after `path` (its matched prefix) to the trie; returns the
        request's blocks the trie keeps (a block another request cached meanwhile is not kept)."""
        bs, kept = self.block_size, set()
        node = path[-1] if path else self.root
        self.clock += 1
        for i in range(len(path), min(len(key) // bs, len(blocks))):
            part = key[i * bs:(i + 1) * bs]
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = Node(part, blocks[i], node)
                kept.add(blocks[i])
                self.cached += 1
            child.used = self.clock
            node = child
        return kept

    def _let_go(self, path: list[Node]) -> None:
        for node in path:
            node.holders -= 1
            assert node.holders >= 0, "a cached block let go more often than held"

    def _evict(self, wanted: int) -> None:
        """Free up to `wanted` cached blocks, least recently used unheld leaves first (a parent
        whose last child goes becomes a leaf)."""
        leaves = [n for n in self._nodes() if not n.children and not n.holders]
        while wanted > 0 and leaves:
            victim = min(leaves, key=lambda n: n.used)
            leaves.remove(victim)
            parent = victim.parent
            assert parent is not None
            del parent.children[victim.key]
            self.free.append(victim.block)
            self.cached -= 1
            wanted -= 1
            if parent is not self.root and not parent.children and not parent.holders:
                leaves.append(parent)

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
