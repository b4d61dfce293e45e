"""Plan groups: the rows of a batch that bypass the same decoder layers.

Design note: requests whose plans apply the same skip set share one left-padded tensor
state and one KV cache (paged, in their skip set's pool), so one forward serves them all and
a skipped layer holds no KV for the group. A group's key is the set of layers bypassed in every
forward (`lossy`). Verified requests share the group of the empty set whatever layers their
drafts bypass: verification runs the full model, and one forward of all rows costs less than
one per draft set (each group's forward streams the weights again); a cycle's draft forwards
bypass the layers that every drafting row's plan bypasses
(`speculative.controller.CyclePlan.skip`). Groups of one batch run one after another (a layer
runs only for the groups that need it). Few distinct plans keep batching efficient; `off`,
`shadow` and `verified` requests always share the group with the empty skip set.

Tensor layout of a group with `rows` rows:
- `cache`: the KV cache, `cache.length` logical columns, each row's tokens right-aligned
  (left padding occupies no blocks, see `models/runner/kv_cache.py`);
- `attention_mask`: `[rows, cache.length]`, 1 for a real token, 0 for left padding;
- `pending_ids` / `pending_mask`: `[rows, new]`, the tokens to run next (the prompts at
  prefill, less a cached prefix or the chunks already run; the last chosen token after), with
  their mask (padding only at prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.runner.kv_cache import BlockPool, KVCache
from .prefix_cache import Hit, LayerKV

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
    fresh: bool = True  # its prompts are not all in the cache yet (cached prefixes or earlier chunks may be)
    prompt_scores: torch.Tensor | None = None  # [rows, run]: prompt logprobs of the chunks run so far

    @classmethod
    def from_prompts(cls, skip: GroupKey, request_ids: list[int], prompts: list[list[int]], pool: BlockPool,
                     pad_id: int, hits: list[Hit | None] | None = None) -> PlanGroup:
        """A group before prefill, its KV in `pool` (its skip set's). Row r's cached prefix
        (`hits[r]`, from the prefix cache) is in its KV cache already, right-aligned to the
        longest; the rest of its prompt is pending, left-padded to the longest rest."""
        hits = hits or [None] * len(prompts)
        cached = [h.length if h is not None else 0 for h in hits]
        past = max(cached)
        width = max(len(p) - c for p, c in zip(prompts, cached, strict=True))
        rows = len(prompts)
        pending_ids = torch.full((rows, width), pad_id, dtype=torch.long)
        pending_mask = torch.zeros((rows, width), dtype=torch.long)
        attention_mask = torch.zeros((rows, past), dtype=torch.long)
        cache = KVCache(rows, pool.num_layers, past, pool)
        for row, (prompt, hit) in enumerate(zip(prompts, hits, strict=True)):
            rest = prompt[cached[row]:]
            pending_ids[row, width - len(rest):] = torch.tensor(rest)
            pending_mask[row, width - len(rest):] = 1
            if hit is not None:
                attention_mask[row, past - hit.length:] = 1
                cache.write_row(row, past, hit.layers)
            else:  # its left padding takes no blocks
                cache.begin(row, past + width - len(rest))
        return cls(skip, request_ids, cache, attention_mask, pending_ids, pending_mask)

    def row_kv(self, request_id: int) -> list[LayerKV]:
        """One row's keys and values per layer, `[kv_heads, n, head_dim]` over its n real columns
        (holes of padding and rejected drafts left out), in the order the tokens came."""
        row = self.request_ids.index(request_id)
        return self.cache.row(row, self.attention_mask[row].nonzero().squeeze(1))

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
        pending_mask = self.pending_mask.index_select(0, index)
        pending = pending_mask.any(0).nonzero()  # a prefilling group: drop the columns all padding now
        start = int(pending.min()) if self.fresh and pending.numel() else 0
        scores = self.prompt_scores.index_select(0, index) if self.prompt_scores is not None else None
        return PlanGroup(self.skip, list(ids), self.cache.select(rows, new_length),
                         mask[:, mask.shape[1] - new_length:],
                         self.pending_ids.index_select(0, index)[:, start:], pending_mask[:, start:], self.fresh,
                         scores)

    def filter(self, keep_ids: list[int]) -> None:
        """Keep the rows of `keep_ids` (in that order), as `select` does, in place."""
        if keep_ids == self.request_ids:
            return
        kept = self.select(keep_ids)
        self.request_ids, self.cache, self.attention_mask = kept.request_ids, kept.cache, kept.attention_mask
        self.pending_ids, self.pending_mask = kept.pending_ids, kept.pending_mask
        self.prompt_scores = kept.prompt_scores

    @classmethod
    def concatenate(cls, groups: list[PlanGroup]) -> PlanGroup:
        """Stack prefilled groups of one key, left-padding to the longest."""
        assert len({g.skip for g in groups}) == 1, "only groups with the same skip set concatenate"
        assert not any(g.fresh for g in groups), "only prefilled groups can be concatenated"
        length = max(g.cache.length for g in groups)
        masks = [torch.nn.functional.pad(g.attention_mask, (length - g.cache.length, 0)) for g in groups]
        return cls(
            skip=groups[0].skip,
            request_ids=[rid for g in groups for rid in g.request_ids],
            cache=KVCache.concatenate([g.cache for g in groups]),
            attention_mask=torch.cat(masks, 0),
            pending_ids=torch.cat([g.pending_ids for g in groups], 0),
            pending_mask=torch.cat([g.pending_mask for g in groups], 0),
            fresh=False,
        )

    def forward_inputs(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids, attention_mask over cache + new) for the next forward of the
        first `width` pending columns (all of them by default; fewer: a chunk of a long prefill)."""
        width = self.pending_ids.shape[1] if width is None else width
        mask = torch.cat([self.attention_mask, self.pending_mask[:, :width]], 1)  # [rows, past + new]
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)[:, -width:]
        return self.pending_ids[:, :width], position_ids, mask

    def add_prompt_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Keep a chunk's prompt logprobs `[rows, width]` after the earlier chunks'; returns them all."""
        self.prompt_scores = scores if self.prompt_scores is None else torch.cat([self.prompt_scores, scores], 1)
        return self.prompt_scores

    def advance_chunk(self, width: int) -> None:
        """After a chunk of a long prefill: its `width` columns are in the cache, the rest pending."""
        self.attention_mask = torch.cat([self.attention_mask, self.pending_mask[:, :width]], 1)
        self.pending_ids, self.pending_mask = self.pending_ids[:, width:], self.pending_mask[:, width:]

    def advance(self, next_ids: list[int]) -> None:
        """After a forward: the pending tokens are in the cache; the chosen ones are next."""
        self.fresh, self.prompt_scores = False, None
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

