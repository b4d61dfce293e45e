"""Drive any runner over a left-padded batch the way the shard's batch code does."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from text_generation_server.models.runner import ForwardInputs, KVCache, Runner


@dataclass
class Stream:
    """One runner's state for a left-padded batch: its cache and attention mask."""

    runner: Runner
    cache: KVCache
    mask: torch.Tensor  # [rows, cache.length]

    @classmethod
    def prefill(cls, runner: Runner, prompts: list[list[int]]) -> tuple[Stream, torch.Tensor]:
        """Run the prompts; returns the stream and logits `[rows, longest, vocab]`."""
        longest = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), longest), dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = runner.new_cache(len(prompts))
        logits = runner.forward(ForwardInputs(ids, positions, mask, last_only=False), cache)
        return cls(runner, cache, mask), logits

    def step(self, next_ids: torch.Tensor, skip_layers: frozenset[int] = frozenset()) -> torch.Tensor:
        """Decode one token per row (`next_ids` `[rows]`); returns logits `[rows, vocab]`."""
        self.mask = torch.cat([self.mask, torch.ones((self.mask.shape[0], 1), dtype=torch.long)], dim=1)
        positions = self.mask.sum(-1, keepdim=True) - 1
        model = self.runner.bypassing(skip_layers)
        logits = model.forward(ForwardInputs(next_ids[:, None], positions, self.mask), self.cache)
        return logits[:, -1]

    def filter(self, rows: list[int]) -> None:
        keep = int(self.mask[rows].sum(-1).max())
        self.cache.filter(rows, keep)
        self.mask = self.mask[rows, -keep:]

    @classmethod
    def concatenate(cls, streams: list[Stream]) -> Stream:
        cache = KVCache.concatenate([s.cache for s in streams])
        masks = [torch.nn.functional.pad(s.mask, (cache.length - s.mask.shape[1], 0)) for s in streams]
        return cls(streams[0].runner, cache, torch.cat(masks, dim=0))


def real_positions(logits: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
    """The prefill logits of real (not padding) positions, flattened to `[tokens, vocab]`."""
    longest = logits.shape[1]
    return torch.cat([logits[row, longest - len(p):] for row, p in enumerate(prompts)])


def teacher_forced(fast: Stream, ref: Stream, ref_logits: torch.Tensor,
                   steps: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Decode `steps` tokens in both streams, each fed the reference's greedy tokens (the first
    from the reference's prefill logits `ref_logits`); yields (step, fast logits, reference logits)."""
    next_ids = ref_logits[:, -1].argmax(-1)
    for step in range(steps):
        fast_step, ref_step = fast.step(next_ids), ref.step(next_ids)
        yield step, fast_step, ref_step
        next_ids = ref_step.argmax(-1)
