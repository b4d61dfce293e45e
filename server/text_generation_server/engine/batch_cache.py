"""The batch cache: batch id -> cached batch. Every Prefill/Decode consumes what it reads."""

from __future__ import annotations

from .batch import CausalLMBatch


class Cache:
    def __init__(self) -> None:
        self.batches: dict[int, CausalLMBatch] = {}

    def pop(self, batch_id: int) -> CausalLMBatch:
        batch = self.batches.pop(batch_id, None)
        if batch is None:
            raise ValueError(f"Batch ID {batch_id} not found in cache.")
        return batch

    def pop_all(self, batch_ids: list[int]) -> list[CausalLMBatch]:
        """Pop several batches, or none of them when one is missing (nothing is lost)."""
        missing = [i for i in batch_ids if i not in self.batches]
        if missing:
            raise ValueError(f"Batch ID {missing[0]} not found in cache.")
        return [self.batches.pop(i) for i in batch_ids]

    def set(self, batch: CausalLMBatch | None) -> None:
        if batch is not None and batch.requests:
            self.batches[batch.batch_id] = batch

    def delete(self, batch_id: int) -> None:
        self.batches.pop(batch_id, None)

    def clear(self) -> None:
        self.batches.clear()

    def __len__(self) -> int:
        return len(self.batches)
