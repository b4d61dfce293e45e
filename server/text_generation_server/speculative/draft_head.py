"""Reduced-vocabulary draft heads: the lm_head rows of a policy's ranked draft vocabulary.

Verified mode drafts with skipped layers and, when the rule says so, with a head over the first
N ids of the policy's `DraftVocab` ranking (see layerskip/draft.py for why this is lossless and
how the ranking is measured). The rows are gathered once, for the largest size any rule uses
(`Runner.head_rows`: dense rows, or the rows of the int8 head a quantized model is served with,
so a draft's logits are the served head's own); a rule's head is a prefix view of them, so no
size costs a second copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..layerskip import DraftVocab
from ..models.runner.base import Runner


@dataclass(frozen=True)
class DraftHead:
    """One reduced head.

    Attributes:
        token_ids: `[n]` the vocabulary ids of the head's rows, in row order.
        weight: the lm_head rows of `token_ids`, as the runner reads them (Runner.head_rows).
    """

    token_ids: torch.Tensor
    weight: Any

    @property
    def size(self) -> int:
        return int(self.token_ids.shape[0])

    def to_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of head columns (argmax results)."""
        return self.token_ids[columns]

    def to_full(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """`[..., n]` head logits as `[..., vocab_size]` logits, -inf outside the head's ids.

        Penalties, grammar masks and the watermark index by token id: a draft under any of them
        is chosen in this form (the draft distribution q is zero outside the subset).
        """
        full = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=logits.dtype)
        full[..., self.token_ids] = logits
        return full


class DraftHeads:
    """The reduced heads of one loaded policy, built lazily from the runner's lm_head rows."""

    def __init__(self, vocab: DraftVocab | None, runner: Runner | None) -> None:
        self.vocab = vocab
        self.runner = runner  # None: no reduced heads (also once its head_rows gave None)
        self._rows: Any = None
        self._heads: dict[int, DraftHead] = {}
        self.max_size = 0

    def reserve(self, size: int) -> None:
        """Make sure heads up to `size` rows can be served (called once per rule at load)."""
        if size <= 0:
            return
        if self.vocab is None or size > len(self.vocab.token_ids):
            ranked = 0 if self.vocab is None else len(self.vocab.token_ids)
            raise ValueError(f"a rule drafts over {size} token ids, but the policy ranks {ranked}")
        self.max_size = max(self.max_size, size)

    def get(self, size: int) -> DraftHead | None:
        """The head of the first `size` ranked ids; None for 0 (the full head) or a full-size subset."""
        if size <= 0 or self.runner is None or size >= self.runner.vocab_size:
            return None
        head = self._heads.get(size)
        if head is None:
            rows = self._gathered(max(size, self.max_size))
            if rows is None:
                return None
            assert self.vocab is not None, "reserve() checked that a ranking exists"
            ids = torch.tensor(self.vocab.token_ids[:size], dtype=torch.long)
            head = self._heads[size] = DraftHead(ids, rows[:size])
        return head

    def _gathered(self, size: int) -> Any:
        if self._rows is None or self._rows.shape[0] < size:
            assert self.vocab is not None and self.runner is not None
            self._rows = self.runner.head_rows(torch.tensor(self.vocab.token_ids[:size], dtype=torch.long))
            self._heads.clear()
            if self._rows is None:  # a runner of whole logits only: asked once, not every cycle
                self.runner = None
        return self._rows
