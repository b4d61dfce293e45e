"""KV cache of a left-padded batch, shared by every runner.

Layout: for each decoder layer, a key and a value buffer of shape
`[num_rows, num_kv_heads, capacity, head_dim]`. All rows share one column count
`length`; a row's valid tokens are right-aligned in `[0, length)` and the columns to their
left are padding (masked by the batch's attention mask, which the batch owns). Appending
writes columns `[length, length + n)` for every row. Buffers grow in buckets so that a decode
step usually writes in place instead of reallocating.

A layer whose entry is None holds no cache at all (a layer skipped for the whole request:
its KV bytes are never allocated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BUCKET = 64  # columns; capacity is always a multiple of it


def round_up(n: int, bucket: int = BUCKET) -> int:
    return max(bucket, (n + bucket - 1) // bucket * bucket)


@dataclass
class KVCache:
    """Per-layer key/value buffers of a left-padded batch (see module docstring)."""

    num_rows: int
    num_layers: int
    length: int = 0
    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.keys:
            self.keys = [None] * self.num_layers
            self.values = [None] * self.num_layers
        assert len(self.keys) == len(self.values) == self.num_layers, "one key/value entry per layer"

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views of the filled columns of one layer: `[rows, kv_heads, length, head_dim]`."""
        k, v = self.keys[index], self.values[index]
        if k is None or v is None:
            return None
        return k[:, :, : self.length], v[:, :, : self.length]

    def append(self, index: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k_new`/`v_new` `[rows, kv_heads, n, head_dim]` after the filled columns.

        The caller advances `length` once per forward with `advance(n)`, after every layer has
        appended. Returns views of the filled columns including the new ones.
        """
        end = self.length + k_new.shape[2]
        rows, heads, _, dim = k_new.shape
        k, v = self.buffers(index, (rows, heads, dim), k_new.dtype, end)
        k[:, :, self.length : end] = k_new
        v[:, :, self.length : end] = v_new
        return k[:, :, :end], v[:, :, :end]

    def buffers(self, index: int, shape: tuple[int, int, int], dtype: torch.dtype,
                end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's whole key and value buffers `[rows, kv_heads, capacity, head_dim]`, grown
        (in buckets, filled columns kept) to hold at least `end` columns. `shape` is
        (rows, kv_heads, head_dim). For writers that fill the columns themselves."""
        k, v = self.keys[index], self.values[index]
        if k is None or v is None or k.shape[2] < end:
            rows, heads, dim = shape
            capacity = round_up(end)
            k = torch.zeros((rows, heads, capacity, dim), dtype=dtype)
            v = torch.zeros((rows, heads, capacity, dim), dtype=dtype)
            old_k, old_v = self.keys[index], self.values[index]
            if old_k is not None and old_v is not None:
                k[:, :, : self.length] = old_k[:, :, : self.length]
                v[:, :, : self.length] = old_v[:, :, : self.length]
            self.keys[index], self.values[index] = k, v
        return k, v

    def advance(self, n: int) -> None:
        """Count n more filled columns (after all layers appended n columns)."""
        self.length += n

    def select(self, rows: list[int], new_length: int) -> KVCache:
        """A new cache of `rows` (in that order) and the last `new_length` columns, in buffers of
        its own; this cache is left as it was."""
        assert 0 <= new_length <= self.length, f"cannot keep {new_length} of {self.length} columns"
        index = torch.tensor(rows, dtype=torch.long)
        start = self.length - new_length
        out = KVCache(num_rows=len(rows), num_layers=self.num_layers, length=new_length)
        for i in range(self.num_layers):
            k, v = self.keys[i], self.values[i]
            if k is None or v is None:
                continue
            capacity = round_up(new_length + 1)
            new_k = k.new_zeros((len(rows), k.shape[1], capacity, k.shape[3]))
            new_v = v.new_zeros((len(rows), v.shape[1], capacity, v.shape[3]))
            new_k[:, :, :new_length] = k.index_select(0, index)[:, :, start : self.length]
            new_v[:, :, :new_length] = v.index_select(0, index)[:, :, start : self.length]
            out.keys[i], out.values[i] = new_k, new_v
        return out

    def filter(self, rows: list[int], new_length: int) -> None:
        """Keep `rows` (in that order) and only the last `new_length` columns, in place."""
        kept = self.select(rows, new_length)
        self.num_rows, self.length, self.keys, self.values = kept.num_rows, kept.length, kept.keys, kept.values

    def crop(self, length: int) -> None:
        """Forget the columns from `length` on (speculative drafts that were rejected)."""
        assert 0 <= length <= self.length, f"cannot crop to {length} of {self.length} columns"
        self.length = length

    @classmethod
    def concatenate(cls, caches: list[KVCache]) -> KVCache:
        """Stack caches along rows, left-padding each to the longest length.

        All caches must have the same layers present (same plan group).
        """
        assert caches, "nothing to concatenate"
        num_layers = caches[0].num_layers
        length = max(c.length for c in caches)
        num_rows = sum(c.num_rows for c in caches)
        out = cls(num_rows=num_rows, num_layers=num_layers, length=length)
        capacity = round_up(length + 1)
        for i in range(num_layers):
            present = [c.keys[i] is not None for c in caches]
            assert all(present) or not any(present), f"layer {i} cached in some batches only"
            if not any(present):
                continue
            first = caches[0].keys[i]
            assert first is not None
            k = first.new_zeros((num_rows, first.shape[1], capacity, first.shape[3]))
            v = torch.zeros_like(k)
            row = 0
            for c in caches:
                ck, cv = c.layer(i)  # type: ignore[misc]
                pad = length - c.length
                k[row : row + c.num_rows, :, pad:length] = ck
                v[row : row + c.num_rows, :, pad:length] = cv
                row += c.num_rows
            out.keys[i], out.values[i] = k, v
        return out

    def nbytes(self) -> int:
        """Bytes held by the buffers (allocated capacity, not only filled columns)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
