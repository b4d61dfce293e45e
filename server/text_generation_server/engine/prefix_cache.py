"""Prefix cache: the keys and values of token sequences the shard has already run, reused by
the prefill of a later prompt that starts with the same tokens.

What is kept: when a request's prompt has been prefilled, and again when it finishes (prompt
plus answer, so that a chat's next turn finds its whole history), its row of its group's KV
cache, per layer `[kv_heads, n, head_dim]`, with the n tokens it covers. Keys and values
computed with layers bypassed differ from the full model's, so each skip set has a tree of
its own and only a group with the same skip set reuses them.

The store is a radix tree over token ids: an edge holds a run of tokens and their keys and
values, so a prefix shared by many sequences (a system prompt, a document) is held once, and
a prompt that diverges inside an edge reuses everything before the divergence (the edge is
split there). At least a prompt's last token is always run again: its logits choose the
first new token.

Memory: once the tree's bytes pass `max_bytes`, the least recently used leaves are evicted
(a shared prefix stays while a sequence that extends it is used).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor] | None  # [kv_heads, n, head_dim] each; None: a skipped layer
MIN_TOKENS = 16  # shorter sequences are not kept


def _slice(layers: list[LayerKV], start: int, stop: int | None = None) -> list[LayerKV]:
    """Columns [start, stop) of every layer, as tensors of their own (a view would keep the
    whole buffer alive)."""
    return [None if kv is None else (kv[0][:, start:stop].clone(), kv[1][:, start:stop].clone()) for kv in layers]


def _nbytes(layers: list[LayerKV]) -> int:
    return sum(t.numel() * t.element_size() for kv in layers if kv is not None for t in kv)


def _agree(edge: list[int], tokens: list[int], start: int) -> int:
    """How many first tokens of `edge` equal tokens[start:]."""
    stop = min(len(edge), len(tokens) - start)
    if edge[:stop] == tokens[start:start + stop]:
        return stop
    return next(i for i in range(stop) if edge[i] != tokens[start + i])


@dataclass(eq=False)
class Node:
    """An edge of the tree: `tokens` after its parent's, with their keys and values."""

    tokens: list[int]
    layers: list[LayerKV]
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the cache's clock at the last lookup or insert through this node


@dataclass(frozen=True)
class Hit:
    """The first `length` tokens of a prompt, found cached: per layer `[kv_heads, length, head_dim]`."""

    length: int
    layers: list[LayerKV]


@dataclass
class PrefixStats:
    """Counters since start."""

    hits: int = 0
    hit_tokens: int = 0
    evicted_tokens: int = 0


@dataclass
class PrefixCache:
    """Cached KV of earlier sequences, one radix tree per skip set (see module docstring)."""

    max_bytes: int
    roots: dict[frozenset[int], Node] = field(default_factory=dict)
    nbytes: int = 0
    tokens: int = 0  # held over all edges
    stats: PrefixStats = field(default_factory=PrefixStats)
    clock: int = 0

    def _walk(self, skip: frozenset[int], tokens: list[int]) -> tuple[list[tuple[Node, int]], int]:
        """The edges `tokens` runs along, each with how many of its tokens agree, and the total."""
        path: list[tuple[Node, int]] = []
        node, matched = self.roots.get(skip), 0
        while node is not None and matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            agree = _agree(child.tokens, tokens, matched)
            path.append((child, agree))
            matched += agree
            if agree < len(child.tokens):
                break
            node = child
        return path, matched

    def lookup(self, skip: frozenset[int], prompt: list[int], count: bool = True) -> Hit | None:
        """The longest cached prefix of `prompt` (all but its last token at most), or None.
        `count`: whether the lookup counts in `stats` (a prompt's, not the shard's own)."""
        path, length = self._walk(skip, prompt[:-1])
        if not length:
            return None
        self.clock += 1
        for node, _ in path:
            node.used = self.clock
        if count:
            self.stats.hits += 1
            self.stats.hit_tokens += length
        parts = [[None if kv is None else (kv[0][:, :agree], kv[1][:, :agree]) for kv in node.layers]
                 for node, agree in path]
        if len(parts) == 1:
            return Hit(length, parts[0])
        layers = [None if kvs[0] is None else (torch.cat([kv[0] for kv in kvs], 1), torch.cat([kv[1] for kv in kvs], 1))  # type: ignore[index]
                  for kvs in zip(*parts, strict=True)]
        return Hit(length, layers)

    def insert(self, skip: frozenset[int], tokens: list[int], layers: list[LayerKV]) -> None:
        """Keep `tokens` with their per-layer KV (`[kv_heads, len(tokens), head_dim]`); the part
        already in the tree is not stored again."""
        if len(tokens) < MIN_TOKENS:
            return
        path, matched = self._walk(skip, tokens)
        self.clock += 1
        for node, _ in path:
            node.used = self.clock
        parent = self.roots.setdefault(skip, Node([], []))
        if path:
            last, agree = path[-1]
            parent = last if agree == len(last.tokens) else self._split(last, agree)
        if matched < len(tokens):
            rest = _slice(layers, matched)
            if _nbytes(rest) > self.max_bytes:
                return
            child = Node(tokens[matched:], rest, parent, used=self.clock)
            parent.children[child.tokens[0]] = child
            self.nbytes += _nbytes(rest)
            self.tokens += len(child.tokens)
        self._evict()

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s edge after `at` tokens; returns the new upper part."""
        assert node.parent is not None and 0 < at < len(node.tokens)
        upper = Node(node.tokens[:at], _slice(node.layers, 0, at), node.parent, used=node.used)
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.layers, node.parent = node.tokens[at:], _slice(node.layers, at), upper
        upper.children[node.tokens[0]] = node
        return upper

    def _evict(self) -> None:
        """Drop least recently used leaves until the bytes fit."""
        while self.nbytes > self.max_bytes:
            leaves = [n for n in self._nodes() if not n.children]
            victim = min(leaves, key=lambda n: n.used)
            assert victim.parent is not None
            del victim.parent.children[victim.tokens[0]]
            self.nbytes -= _nbytes(victim.layers)
            self.tokens -= len(victim.tokens)
            self.stats.evicted_tokens += len(victim.tokens)

    def _nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def clear(self) -> None:
        self.roots.clear()
        self.nbytes = self.tokens = 0
