"""Plan groups: the rows of a batch that bypass the same decoder layers.

Design note: requests whose plans apply the same skip set share one left-padded tensor
state and one KV cache, so one forward serves them all and a skipped layer allocates no cache
for the group. A group's key is the set of layers bypassed in every forward (`lossy`). Verified
requests share the group of the empty set whatever layers their drafts bypass: verification runs
the full model, and one forward of all rows costs less than one per draft set (each group's
forward streams the weights again); a cycle's draft forwards bypass the
layers that every drafting row's plan bypasses (`speculative.controller.CyclePlan.skip`). Groups of one
batch run one after another (a layer runs only for the groups that need it). Few distinct plans
keep batching efficient; `off`, `shadow` and `verified` requests always share the group with
the empty skip set.

Tensor layout of a group with `rows` rows:
- `cache`: the KV cache, `cache.length` columns, each row's tokens right-aligned;
- `attention_mask`: `[rows, cache.length]`, 1 for a real token, 0 for left padding;
- `pending_ids` / `pending_mask`: `[rows, new]`, the tokens to run next (the prompts at
  prefill, the last chosen token after), with their mask (padding only at prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.runner.kv_cache import KVCache

GroupKey = frozenset[int]  # the layers bypassed in every forward of a group


@dataclass
class PlanGroup:
    """Rows sharing one skip set, with their own tensors and KV cache (see module docstring)."""

    skip: GroupKey  # bypassed in every forward of the group (lossy)
    request_ids: list[int]  # row order of the tensors below
    cache: KVCache
    attention_mask: torch.Tensor  # [rows, cache.length]
    pending_ids: torch.Tensor  # [rows, new]
    pending_mask: torch.Tensor  # [rows, new]

    @classmethod
    def from_prompts(cls, skip: GroupKey, request_ids: list[int], prompts: list[list[int]],
                     cache: KVCache, pad_id: int) -> PlanGroup:
        """A group before prefill: prompts left-padded to the longest."""
        width = max(len(p) for p in prompts)
        pending_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        pending_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            pending_ids[row, width - len(prompt):] = torch.tensor(prompt)
            pending_mask[row, width - len(prompt):] = 1
        empty = torch.zeros((len(prompts), 0), dtype=torch.long)
        return cls(skip, request_ids, cache, empty, pending_ids, pending_mask)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def width(self) -> int:
        """Columns in the cache plus pending (the padded length a forward sees)."""
        return self.attention_mask.shape[1] + self.pending_ids.shape[1]

    def select(self, ids: list[int]) -> PlanGroup:
        """A new group of the rows of `ids` (in that order), trimmed of the columns that became
        all padding; this group is left as it was.

        A row's masked columns need not be contiguous (verified mode masks the rejected draft
        columns of a row in place), so the trim keeps everything from the leftmost real token
        of any kept row.
        """
        position = {rid: row for row, rid in enumerate(self.request_ids)}
        rows = [position[rid] for rid in ids]
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.attention_mask.index_select(0, index)
        used = mask.any(0).nonzero()
        new_length = mask.shape[1] - int(used.min()) if self.cache.length and used.numel() else 0
        return PlanGroup(self.skip, list(ids), self.cache.select(rows, new_length),
                         mask[:, mask.shape[1] - new_length:],
                         self.pending_ids.index_select(0, index), self.pending_mask.index_select(0, index))

    def filter(self, keep_ids: list[int]) -> None:
        """Keep the rows of `keep_ids` (in that order), as `select` does, in place."""
        if keep_ids == self.request_ids:
            return
        kept = self.select(keep_ids)
        self.request_ids, self.cache, self.attention_mask = kept.request_ids, kept.cache, kept.attention_mask
        self.pending_ids, self.pending_mask = kept.pending_ids, kept.pending_mask

    @classmethod
    def concatenate(cls, groups: list[PlanGroup]) -> PlanGroup:
        """Stack prefilled groups of one key, left-padding to the longest."""
        assert len({g.skip for g in groups}) == 1, "only groups with the same skip set concatenate"
        assert all(g.cache.length for g in groups), "only prefilled groups can be concatenated"
        length = max(g.cache.length for g in groups)
        masks = [torch.nn.functional.pad(g.attention_mask, (length - g.cache.length, 0)) for g in groups]
        return cls(
            skip=groups[0].skip,
            request_ids=[rid for g in groups for rid in g.request_ids],
            cache=KVCache.concatenate([g.cache for g in groups]),
            attention_mask=torch.cat(masks, 0),
            pending_ids=torch.cat([g.pending_ids for g in groups], 0),
            pending_mask=torch.cat([g.pending_mask for g in groups], 0),
        )

    def forward_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids, attention_mask over cache + pending) for the next forward."""
        mask = torch.cat([self.attention_mask, self.pending_mask], 1)  # [rows, past + new]
        new = self.pending_ids.shape[1]
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)[:, -new:]
        return self.pending_ids, position_ids, mask

    def advance(self, next_ids: list[int]) -> None:
        """After a forward: the pending tokens are in the cache; the chosen ones are next."""
        self.attention_mask = torch.cat([self.attention_mask, self.pending_mask], 1)
        self.pending_ids = torch.tensor(next_ids, dtype=torch.long).unsqueeze(1)
        self.pending_mask = torch.ones((len(next_ids), 1), dtype=torch.long)

    def discard_drafts(self) -> None:
        """After draft forwards: their columns leave the cache, which ends where the mask does."""
        self.cache.crop(self.attention_mask.shape[1])

    def verify_inputs(self, drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids, attention_mask) of a verification forward: each row's
        pending token then its drafts, right-padded to the longest (`accept_drafts` masks the
        padding out with the rejected drafts)."""
        width = max(len(d) for d in drafts)
        assert width > 0, "a cycle without drafts is a plain step"
        padded = [d + [0] * (width - len(d)) for d in drafts]
        ids = torch.cat([self.pending_ids, torch.tensor(padded, dtype=torch.long).view(self.num_rows, width)], 1)
        mask = torch.cat([self.attention_mask, torch.ones((self.num_rows, width + 1), dtype=torch.long)], 1)
        positions = (mask.cumsum(1) - 1)[:, -(width + 1):]
        return ids, positions, mask

    def accept_drafts(self, kept: list[int], next_ids: list[int]) -> None:
        """After a verification forward: row r keeps its pending token and its first `kept[r]`
        drafts; the columns of its other drafts are masked, those no row kept are cropped, and
        `next_ids` (each row's last accepted token) are pending."""
        start = self.attention_mask.shape[1]
        verified = self.cache.length - start  # the pending token and the (padded) drafts
        mask = torch.cat([self.attention_mask, torch.ones((self.num_rows, verified), dtype=torch.long)], 1)
        for row, k in enumerate(kept):
            mask[row, start + 1 + k:] = 0
        keep = start + 1 + max(kept)
        self.cache.crop(keep)
        self.attention_mask = mask[:, :keep]
        self.pending_ids = torch.tensor([[t] for t in next_ids], dtype=torch.long)
        self.pending_mask = torch.ones((self.num_rows, 1), dtype=torch.long)
