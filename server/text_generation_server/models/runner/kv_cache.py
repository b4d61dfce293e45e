"""Paged KV cache, shared by every runner.

Storage: a `BlockPool` holds, for each decoder layer that writes, a key and a value tensor of
`[blocks, kv_heads, block_size, head_dim]`, handed out by block; slot `s` (one token's keys or
values) is place `s % block_size` of block `s // block_size`, so one head's columns of a block
are contiguous, as attention reads them. Block 0 is never handed out: its slots stay zero, and
every padding column reads slot 0. A block is freed when the last cache holding it lets go
(blocks are counted).

Addressing: a `KVCache` is a batch's view of the pool. Its rows share one logical column count
`length`, with each row's tokens right-aligned (the batch code's attention mask says which
columns are real, as with left padding); row r holds a block table and a `start`: its logical
column `c >= start` lives in slot `table[(c - start) // bs] * bs + (c - start) % bs`, and the
columns before `start` are padding: slot 0, no memory, never written (a forward's writes there
are dropped) and skipped by the kernels' attention. So stacking batches (left padding
to the longest) and dropping rows move block ids, never keys and values, and a finished row's
blocks go back to the pool at once. A forward writes its new columns into slots reserved for
them (`reserve`) and reads the cache through `slots`, `[rows, columns]` slot ids: the CPU
kernels' attention reads the pool through them in place; the torch paths gather the columns
they need (`layer`).

A layer a batch skips for its whole life writes nothing: a pool allocates a layer's tensors on
its first write, and a runner keeps one pool per skip set (`PoolSet`), so a lossy plan's
bypassed layers hold no KV bytes at all. The pools' tensors are written in inference mode only
(as forwards run).
"""

from __future__ import annotations

import contextlib
import math

import torch

BLOCK_SIZE = 64  # tokens per block: 16 decoded 8 rows of 600 tokens 10-15% slower than a dense cache, 64 as fast
INITIAL_BLOCKS = 64


class BlockPool:
    """Key/value slots of the layers that write, handed out in counted blocks (module docstring)."""

    def __init__(self, num_layers: int, block_size: int = BLOCK_SIZE) -> None:
        self.num_layers, self.block_size = num_layers, block_size
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.refs = [1]  # block 0: the zero block, held forever
        self.free: list[int] = []

    @property
    def capacity(self) -> int:
        """Blocks the tensors hold (block 0 included)."""
        return len(self.refs)

    @property
    def used_blocks(self) -> int:
        return self.capacity - 1 - len(self.free)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each held once by the caller."""
        if n > len(self.free):
            self._grow(self.capacity + n - len(self.free))
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def hold(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            assert self.refs[b] >= 0, f"block {b} released more often than held"
            if self.refs[b] == 0:
                self.free.append(b)
        if blocks and self.used_blocks == 0:  # idle: give the memory back
            self.keys = [None] * self.num_layers
            self.values = [None] * self.num_layers
            self.refs, self.free = [1], []

    @torch.inference_mode()
    def _grow(self, wanted: int) -> None:
        old = self.capacity
        capacity = max(wanted, 2 * old, INITIAL_BLOCKS)
        for i in range(self.num_layers):
            for tensors in (self.keys, self.values):
                t = tensors[i]
                if t is not None:
                    grown = t.new_zeros((capacity, *t.shape[1:]))
                    grown[: t.shape[0]] = t
                    tensors[i] = grown
        self.refs += [0] * (capacity - old)
        self.free += range(capacity - 1, old - 1, -1)  # lowest ids first

    @torch.inference_mode()
    def layer(self, index: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values `[capacity, heads, block_size, dim]`, allocated on first
        use."""
        k, v = self.keys[index], self.values[index]
        if k is None or v is None:
            shape = (self.capacity, heads, self.block_size, dim)
            k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            self.keys[index], self.values[index] = k, v
        return k, v

    def block_bytes(self) -> int:
        """Bytes one block takes over the layers written so far."""
        return sum(t[0].numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


class KVCache:
    """One batch's rows of a `BlockPool`: block tables, starts and a shared length (module docstring)."""

    def __init__(self, num_rows: int, num_layers: int, length: int = 0, pool: BlockPool | None = None) -> None:
        self.num_rows, self.num_layers, self.length = num_rows, num_layers, length
        self.pool = pool if pool is not None else BlockPool(num_layers)
        assert self.pool.num_layers == num_layers, "the pool serves another model"
        self.tables: list[list[int]] = [[] for _ in range(num_rows)]
        self.starts = [length] * num_rows  # a new row's tokens begin at the end
        self._slots: torch.Tensor | None = None  # slot ids of columns [0, reserved end)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the pool may be gone
            self.release()

    def release(self) -> None:
        """Give every block back (the cache is empty afterwards)."""
        for table in self.tables:
            self.pool.release(table)
        self.tables = [[] for _ in range(self.num_rows)]
        self.starts = [self.length] * self.num_rows
        self._slots = None

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def blocks(self) -> int:
        """Blocks this cache holds (a block shared by two of its rows counts once)."""
        return len({b for table in self.tables for b in table})

    def nbytes(self) -> int:
        """Bytes of the blocks held, over the layers the pool stores."""
        return self.blocks() * self.pool.block_bytes()

    # ---- writing ------------------------------------------------------------------------------
    def reserve(self, new: int) -> torch.Tensor:
        """Blocks for `new` more columns in every row; returns the slot ids `[rows, length + new]`
        of the columns a forward of `new` tokens reads and writes (repeat calls are free)."""
        end = self.length + new
        if self._slots is not None and self._slots.shape[1] == end:
            return self._slots
        bs = self.block_size
        for row, table in enumerate(self.tables):
            needed = math.ceil(max(0, end - self.starts[row]) / bs)
            if needed > len(table):
                table += self.pool.allocate(needed - len(table))
        self._slots = self.slots(end)
        return self._slots

    def slots(self, end: int) -> torch.Tensor:
        """Slot ids `[rows, end]` of logical columns `[0, end)` (0 for padding)."""
        bs = self.block_size
        width = max((len(t) for t in self.tables), default=0)
        table = torch.zeros((self.num_rows, max(width, 1)), dtype=torch.long)
        for row, blocks in enumerate(self.tables):
            if blocks:
                table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        starts = torch.tensor(self.starts, dtype=torch.long).unsqueeze(1)
        position = torch.arange(end, dtype=torch.long).unsqueeze(0) - starts  # [rows, end]
        lengths = torch.tensor([len(t) for t in self.tables], dtype=torch.long).unsqueeze(1) * bs
        valid = (position >= 0) & (position < lengths)
        block = table.gather(1, (position // bs).clamp(0, table.shape[1] - 1))
        return torch.where(valid, block * bs + position % bs, 0)

    def buffers(self, index: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s key and value slots in the pool (for kernels that write through `slots`;
        `reserve` first: it may grow the pool)."""
        return self.pool.layer(index, heads, dim, dtype)

    @torch.inference_mode()
    def write(self, index: int, k_new: torch.Tensor,
              v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write `k_new`/`v_new` `[rows, kv_heads, n, head_dim]` after the filled columns (but a
        row's padding before its `start`, which is not stored); returns the layer's key and value
        slots and the slot ids `[rows, length + n]` that read them.

        The caller advances `length` once per forward with `advance(n)`, after every layer has
        written."""
        _, heads, n, dim = k_new.shape
        slots = self.reserve(n)
        k, v = self.pool.layer(index, heads, dim, k_new.dtype)
        new_slots = slots[:, self.length :]
        stored = new_slots != 0
        written = self._at(new_slots[stored], k)
        k.transpose(1, 2)[written] = k_new.transpose(1, 2)[stored]
        v.transpose(1, 2)[written] = v_new.transpose(1, 2)[stored]
        return k, v, slots

    def append(self, index: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`write`, then the layer's keys and values `[rows, kv_heads, length + n, head_dim]`
        (gathered copies, for the torch paths)."""
        k, v, slots = self.write(index, k_new, v_new)
        return self._gather(k, slots), self._gather(v, slots)

    def advance(self, n: int) -> None:
        """Count n more filled columns (after all layers appended n columns)."""
        self.length += n
        self._slots = None

    # ---- reading ------------------------------------------------------------------------------
    @staticmethod
    def _at(slots: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (block, place) indices of `slots` in `pool.transpose(1, 2)`, `[blocks, block_size,
        heads, dim]`: indexing that view with them reads or writes `[*slots.shape, heads, dim]`."""
        size = pool.shape[2]
        return slots // size, slots % size

    @classmethod
    def _gather(cls, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`[rows, heads, columns, dim]` copies of the slots `[rows, columns]`."""
        return pool.transpose(1, 2)[cls._at(slots, pool)].transpose(1, 2)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copies of one layer's filled columns `[rows, kv_heads, length, head_dim]`; None for a
        layer the pool never stored."""
        k, v = self.pool.keys[index], self.pool.values[index]
        if k is None or v is None:
            return None
        slots = self.slots(self.length)
        return self._gather(k, slots), self._gather(v, slots)

    def row(self, row: int, columns: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of one row's keys and values at logical `columns`, `[kv_heads, n, head_dim]` per
        layer (None for a layer the pool never stored)."""
        slots = self.slots(self.length)[row].index_select(0, columns).unsqueeze(0)
        return [None if k is None or v is None else (self._gather(k, slots)[0], self._gather(v, slots)[0])
                for k, v in zip(self.pool.keys, self.pool.values, strict=True)]

    # ---- rows and columns ---------------------------------------------------------------------
    def begin(self, row: int, column: int) -> None:
        """Row `row`'s tokens begin at logical column `column` (those before are its padding, not
        stored); the row must hold nothing yet."""
        assert not self.tables[row], "a row begins before it holds blocks"
        self.starts[row] = column
        self._slots = None

    @torch.inference_mode()
    def write_row(self, row: int, end: int, layers: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one row's keys and values (`[kv_heads, n, head_dim]` per layer, None where the layer
        has none) in its columns `[end - n, end)`; the row must hold nothing yet."""
        assert not self.tables[row], "write_row fills an empty row"
        n = next((kv[0].shape[1] for kv in layers if kv is not None), 0)
        if n == 0:
            return
        self.starts[row] = end - n
        self.tables[row] = self.pool.allocate(math.ceil(n / self.block_size))
        slots = self.slots(end)[row, end - n :]
        for i, kv in enumerate(layers):
            if kv is not None:
                k_row, v_row = kv
                k, v = self.pool.layer(i, k_row.shape[0], k_row.shape[2], k_row.dtype)
                at = self._at(slots, k)
                k.transpose(1, 2)[at] = k_row.transpose(0, 1)
                v.transpose(1, 2)[at] = v_row.transpose(0, 1)
        self._slots = None

    def select(self, rows: list[int], new_length: int) -> KVCache:
        """A cache of `rows` (in that order) and the last `new_length` columns, holding the same
        blocks (nothing is copied); this cache is left as it was."""
        assert 0 <= new_length <= self.length, f"cannot keep {new_length} of {self.length} columns"
        dropped = self.length - new_length
        out = KVCache(len(rows), self.num_layers, new_length, self.pool)
        bs = self.block_size
        for new_row, row in enumerate(rows):
            start, table = self.starts[row] - dropped, self.tables[row]
            gone = max(0, -start) // bs  # whole blocks left of the kept columns
            table = table[gone:]
            self.pool.hold(table)
            out.tables[new_row], out.starts[new_row] = table, start + gone * bs
        return out

    def filter(self, rows: list[int], new_length: int) -> None:
        """Keep `rows` (in that order) and only the last `new_length` columns, in place."""
        kept = self.select(rows, new_length)
        self.release()
        self.num_rows, self.length, self.tables, self.starts = kept.num_rows, kept.length, kept.tables, kept.starts
        kept.tables = []  # its holds are ours now
        self._slots = None

    def crop(self, length: int) -> None:
        """Forget the columns from `length` on (speculative drafts that were rejected); blocks
        left wholly past them go back to the pool."""
        assert 0 <= length <= self.length, f"cannot crop to {length} of {self.length} columns"
        self.length = length
        for row, table in enumerate(self.tables):
            needed = math.ceil(max(0, length - self.starts[row]) / self.block_size)
            if needed < len(table):
                self.pool.release(table[needed:])
                del table[needed:]
        self._slots = None

    @classmethod
    def concatenate(cls, caches: list[KVCache]) -> KVCache:
        """Stack caches along rows, left-padding each to the longest length (block ids only)."""
        assert caches, "nothing to concatenate"
        pool = caches[0].pool
        assert all(c.pool is pool for c in caches), "caches of different pools (skip sets) do not stack"
        length = max(c.length for c in caches)
        out = cls(sum(c.num_rows for c in caches), caches[0].num_layers, length, pool)
        row = 0
        for c in caches:
            for table, start in zip(c.tables, c.starts, strict=True):
                pool.hold(table)
                out.tables[row], out.starts[row] = list(table), start + length - c.length
                row += 1
        return out


class PoolSet:
    """The shard's pools: one per skip set, so that a lossy plan's bypassed layers hold no blocks."""

    def __init__(self, num_layers: int, block_size: int = BLOCK_SIZE) -> None:
        self.num_layers, self.block_size = num_layers, block_size
        self.pools: dict[frozenset[int], BlockPool] = {}

    def __call__(self, skip: frozenset[int]) -> BlockPool:
        pool = self.pools.get(skip)
        if pool is None:
            pool = self.pools[skip] = BlockPool(self.num_layers, self.block_size)
        return pool

    def used_blocks(self) -> int:
        return sum(p.used_blocks for p in self.pools.values())

    def nbytes(self) -> int:
        """Bytes the pools hold, their free blocks included."""
        return sum(p.nbytes() for p in self.pools.values())

    def used_bytes(self) -> int:
        """Bytes of the blocks in use."""
        return sum(p.used_blocks * p.block_bytes() for p in self.pools.values())
