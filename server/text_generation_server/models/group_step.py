"""One step of one plan group: a plain forward (off, shadow, lossy, and every prefill), or a
draft-verify cycle (verified decode, see speculative.py). Each returns, per request, the
tokens it chose this step and the logits they came from, and leaves the group ready for the
next step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .batch import RequestState
from .plan_groups import PlanGroup
from .runner.base import Runner
from .speculative import Proposal, accept, draft_token


@dataclass
class RowStep:
    """What one request got from one step.

    Attributes:
        token_ids / logprobs: the chosen tokens, in order (several in verified mode).
        logits: `[len(token_ids), vocab]` the (full-model) logits each token was chosen from.
        prompt_logits: `[prompt, vocab]` at prefill, when prompt logprobs were asked for.
        drafted / accepted: draft tokens proposed and kept (verified mode).
    """

    token_ids: list[int]
    logprobs: list[float]
    logits: torch.Tensor
    prompt_logits: torch.Tensor | None = None
    drafted: int = 0
    accepted: int = 0


Biases = Mapping[int, torch.Tensor]  # graceful bypass: layer index -> mean residual update [hidden]


def plain_step(runner: Runner, group: PlanGroup, states: list[RequestState], biases: Biases) -> dict[int, RowStep]:
    """One forward of the group with its skip set, one token per row."""
    prefill = group.cache.length == 0
    all_positions = prefill and any(s.prefill_logprobs for s in states)
    input_ids, position_ids, mask = group.forward_inputs()
    logits = runner.forward(input_ids, position_ids, mask, group.cache, last_only=not all_positions,
                            skip_layers=group.skip, bypass_biases=biases)  # [rows, 1 | new, vocab]
    last = logits[:, -1]  # [rows, vocab]
    choices = choose_tokens(last, states)
    for s, (token, _) in zip(states, choices, strict=True):
        s.chooser.accept(token)
    group.advance([token for token, _ in choices])
    return {
        s.id: RowStep([token], [logprob], last[row : row + 1],
                      logits[row] if prefill and s.prefill_logprobs else None)
        for row, (s, (token, logprob)) in enumerate(zip(states, choices, strict=True))
    }


def choose_tokens(last: torch.Tensor, states: list[RequestState]) -> list[tuple[int, float]]:
    """(token, logprob) per row of `last` `[rows, vocab]`: one batched argmax for the plain-greedy
    rows, each request's chooser (watermark, penalties, grammar, warpers, sampling) for the others."""
    plain = [row for row, s in enumerate(states) if s.chooser.is_plain_greedy]
    choices: dict[int, tuple[int, float]] = {}
    if plain:
        logprobs = last[plain].log_softmax(-1)  # [plain rows, vocab]
        ids = logprobs.argmax(-1)
        values = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
        choices.update(zip(plain, zip(ids.tolist(), values, strict=True), strict=True))
    for row, s in enumerate(states):
        if row not in choices:
            choices[row] = s.chooser(last[row], torch.tensor(s.all_ids))
    return [choices[row] for row in range(len(states))]


def verified_step(runner: Runner, group: PlanGroup, states: list[RequestState], k: int,
                  biases: Biases) -> dict[int, RowStep]:
    """A draft-verify cycle of k drafts for every row of a prefilled group."""
    cache, start = group.cache, group.cache.length
    rows = group.num_rows
    proposals = [Proposal() for _ in states]
    ids, mask = group.pending_ids, torch.cat([group.attention_mask, group.pending_mask], 1)
    for _ in range(k):  # drafts: the group's draft layers bypassed
        positions = (mask.cumsum(1) - 1)[:, -1:]
        logits = runner.forward(ids, positions, mask, cache, skip_layers=group.draft_skip,
                                bypass_biases=biases)[:, -1]  # [rows, vocab]
        drafted = [draft_token(s.chooser.params, s.chooser.generator, logits[row], s.all_ids + p.token_ids, p,
                               s.chooser) for row, (s, p) in enumerate(zip(states, proposals, strict=True))]
        ids = torch.tensor(drafted, dtype=torch.long)[:, None]
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], 1)
    cache.crop(start)  # no draft hidden state stays in the cache
    verify_ids = torch.cat([group.pending_ids, torch.tensor([p.token_ids for p in proposals], dtype=torch.long)], 1)
    verify_mask = torch.cat([group.attention_mask, torch.ones((rows, k + 1), dtype=torch.long)], 1)
    positions = (verify_mask.cumsum(1) - 1)[:, -(k + 1):]
    logits = runner.forward(verify_ids, positions, verify_mask, cache, last_only=False)  # [rows, k + 1, vocab]
    steps: dict[int, RowStep] = {}
    for row, (s, p) in enumerate(zip(states, proposals, strict=True)):
        tokens, logprobs, kept = accept(s.chooser.params, s.chooser.generator, logits[row], s.all_ids, p, s.chooser)
        steps[s.id] = RowStep(tokens, logprobs, logits[row, : len(tokens)], drafted=k, accepted=kept)
        verify_mask[row, start + 1 + kept:] = 0  # the rejected drafts of this row
    keep = start + 1 + max(step.accepted for step in steps.values())
    cache.crop(keep)
    group.attention_mask = verify_mask[:, :keep]
    group.pending_ids = torch.tensor([[steps[s.id].token_ids[-1]] for s in states], dtype=torch.long)
    group.pending_mask = torch.ones((rows, 1), dtype=torch.long)
    return steps
