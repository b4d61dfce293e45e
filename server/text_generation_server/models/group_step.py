"""One step of one plan group: a plain forward (off, shadow, lossy, and every prefill), or a
draft-verify cycle (speculating decode: verified mode or --speculate, see speculative.py).
Each returns, per request, the tokens it chose this step and the logits they came from, and
leaves the group ready for the next step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..sampling import Proposal, accept, choose_tokens, copied_drafts, draft_token
from .batch import RequestState
from .draft_control import CyclePlan
from .draft_head import DraftHead
from .plan_groups import PlanGroup
from .runner.base import Runner


@dataclass
class RowStep:
    """What one request got from one step.

    Attributes:
        token_ids / logprobs: the chosen tokens, in order (several in verified mode).
        logits: `[len(token_ids), vocab]` the (full-model) logits each token was chosen from.
        prompt_logits: `[prompt, vocab]` at prefill, when prompt logprobs were asked for.
        drafted / accepted: draft tokens proposed and kept (verified mode).
        source: the drafter of this step's drafts ("model" or "ngram").
    """

    token_ids: list[int]
    logprobs: list[float]
    logits: torch.Tensor
    prompt_logits: torch.Tensor | None = None
    drafted: int = 0
    accepted: int = 0
    source: str = "model"


Biases = Mapping[int, torch.Tensor]  # graceful bypass: layer index -> mean residual update [hidden]


def plain_step(runner: Runner, group: PlanGroup, states: list[RequestState], biases: Biases) -> dict[int, RowStep]:
    """One forward of the group with its skip set, one token per row."""
    prefill = group.cache.length == 0
    all_positions = prefill and any(s.prefill_logprobs for s in states)
    input_ids, position_ids, mask = group.forward_inputs()
    logits = runner.forward(input_ids, position_ids, mask, group.cache, last_only=not all_positions,
                            skip_layers=group.skip, bypass_biases=biases)  # [rows, 1 | new, vocab]
    last = logits[:, -1]  # [rows, vocab]
    choices = choose_tokens(last, [s.chooser for s in states], [s.all_ids for s in states])
    group.advance([token for token, _ in choices])
    return {
        s.id: RowStep([token], [logprob], last[row : row + 1],
                      logits[row] if prefill and s.prefill_logprobs else None)
        for row, (s, (token, logprob)) in enumerate(zip(states, choices, strict=True))
    }


def verified_step(runner: Runner, group: PlanGroup, states: list[RequestState], cycle: CyclePlan,
                  biases: Biases, head: DraftHead | None = None) -> dict[int, RowStep]:
    """A draft-verify cycle of a prefilled group: copied drafts where the plan has them, model
    drafts (`cycle.model_k` forwards with the group's draft layers bypassed and `head`) for the
    other drafting rows, then one full forward over every row's drafts (see speculative.py)."""
    cache, start = group.cache, group.cache.length
    rows = group.num_rows
    proposals = [copied_drafts(ng, s.chooser.generator is not None) if ng else Proposal()
                 for s, ng in zip(states, cycle.ngram, strict=True)]
    if cycle.model_k:
        _model_drafts(runner, group, states, cycle, proposals, biases, head)
        cache.crop(start)  # no draft hidden state stays in the cache
    width = max(len(p.token_ids) for p in proposals)
    assert width > 0, "a cycle without drafts is a plain step"
    padded = [p.token_ids + [0] * (width - len(p.token_ids)) for p in proposals]  # padding: masked below
    verify_ids = torch.cat([group.pending_ids, torch.tensor(padded, dtype=torch.long).view(rows, width)], 1)
    verify_mask = torch.cat([group.attention_mask, torch.ones((rows, width + 1), dtype=torch.long)], 1)
    positions = (verify_mask.cumsum(1) - 1)[:, -(width + 1):]
    logits = runner.forward(verify_ids, positions, verify_mask, cache, last_only=False)  # [rows, width + 1, vocab]
    steps: dict[int, RowStep] = {}
    for row, (s, p) in enumerate(zip(states, proposals, strict=True)):
        drafted = len(p.token_ids)
        tokens, logprobs, kept = accept(s.chooser.params, s.chooser.generator, logits[row, : drafted + 1],
                                        s.all_ids, p, s.chooser)
        steps[s.id] = RowStep(tokens, logprobs, logits[row, : len(tokens)], drafted=drafted, accepted=kept,
                              source=p.source)
        verify_mask[row, start + 1 + kept:] = 0  # the rejected (and padding) drafts of this row
    keep = start + 1 + max(step.accepted for step in steps.values())
    cache.crop(keep)
    group.attention_mask = verify_mask[:, :keep]
    group.pending_ids = torch.tensor([[steps[s.id].token_ids[-1]] for s in states], dtype=torch.long)
    group.pending_mask = torch.ones((rows, 1), dtype=torch.long)
    return steps


def _model_drafts(runner: Runner, group: PlanGroup, states: list[RequestState], cycle: CyclePlan,
                  proposals: list[Proposal], biases: Biases, head: DraftHead | None) -> None:
    """`cycle.model_k` draft forwards over the whole group; rows with copied drafts feed them
    (their outputs are ignored), the model rows get the draft model's tokens."""
    rows = group.num_rows
    ids, mask = group.pending_ids, torch.cat([group.attention_mask, group.pending_mask], 1)
    for j in range(cycle.model_k):
        positions = (mask.cumsum(1) - 1)[:, -1:]
        logits = runner.forward(ids, positions, mask, group.cache, skip_layers=group.draft_skip,
                                bypass_biases=biases, head=head.weight if head is not None else None)[:, -1]
        fed = []
        for row, (s, p) in enumerate(zip(states, proposals, strict=True)):
            if cycle.model_rows[row]:
                fed.append(draft_token(s.chooser.params, s.chooser.generator, logits[row], s.all_ids + p.token_ids,
                                       p, head, runner.vocab_size, s.chooser))
            else:  # a copied or a non-drafting row: keep its tensors in step, its output is unused
                fed.append(p.token_ids[j] if j < len(p.token_ids) else int(ids[row, -1]))
        ids = torch.tensor(fed, dtype=torch.long)[:, None]
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], 1)
