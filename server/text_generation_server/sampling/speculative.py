"""Speculative token choice: drafting a token, and accepting drafts against the full model.

The rules (see models/speculative.py for the cycle around them): greedy drafts are the draft
model's argmax and a draft is kept while it equals the full model's argmax; sampled drafts are
drawn from the warped draft distribution q and d_j is kept with probability
min(1, p(d_j) / q(d_j)), else the token is drawn from the residual max(p - q, 0), so the output
follows the full model's distribution p exactly. Both positions go through the request's own
processors (the chooser: watermark, penalties, grammar mask, warpers), as plain decoding does.
Copied (n-gram) drafts are point distributions (q(d) = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .chooser import NextTokenChooser, SamplingParams, apply_penalties, apply_warpers

if TYPE_CHECKING:  # the model side imports this package; a runtime import would be circular
    from ..models.draft_head import DraftHead


@dataclass
class Proposal:
    """One row's drafts: token ids and the draft distributions they came from.

    `draft_probs[j]` is the `[vocab]` distribution d_j was drawn from (sampling only), or None
    for a copied n-gram draft: a point distribution, q(d_j) = 1.
    """

    token_ids: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    source: str = "model"  # "model" (layer-skip draft) or "ngram"
    grammar_steps: int = 0  # model drafts the grammar matcher advanced over (none once it terminated)


def target_logits(params: SamplingParams, logits: torch.Tensor, prefix: list[int],
                  chooser: NextTokenChooser | None = None) -> torch.Tensor:
    """One position's logits through the request's processors, given the tokens before it:
    the chooser's (watermark, penalties, grammar mask in the matcher's current state, warpers),
    or, without a chooser, penalties and warpers."""
    if chooser is not None:
        return chooser.process(logits, torch.tensor(prefix, dtype=torch.long))
    out = apply_penalties(logits.clone(), params, torch.tensor(prefix, dtype=torch.long))
    return apply_warpers(out, params) if params.has_warpers else out


def draft_token(params: SamplingParams, generator: torch.Generator | None, logits: torch.Tensor,
                prefix: list[int], proposal: Proposal, head: DraftHead | None = None, vocab_size: int = 0,
                chooser: NextTokenChooser | None = None) -> int:
    """Choose one draft token (greedy argmax, or a draw from the warped draft distribution);
    with a chooser that has a grammar, the matcher advances over it (`accept` rolls it back).

    Args:
        logits: `[vocab]`, or `[head.size]` when the draft ran a reduced head.
        head / vocab_size: the reduced head and the full vocabulary size (for sampling, penalties
            and grammar masks, which need the full-vocabulary form; q is zero outside the head's ids).
    """
    if head is not None and params.is_plain_greedy and (chooser is None or chooser.is_plain_greedy):
        token = int(head.to_ids(logits.argmax()))
    else:
        full = head.to_full(logits, vocab_size) if head is not None else logits
        warped = target_logits(params, full, prefix, chooser)
        if generator is None or not bool(torch.isfinite(warped).any()):
            # greedy, or a grammar that allows none of the reduced head's words: a point draft
            # (q(d) = 1; verification rejects it unless the full model agrees)
            token = int(warped.argmax())
            if generator is not None:
                proposal.draft_probs.append(None)
        else:
            probs = warped.softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            proposal.draft_probs.append(probs)
    proposal.token_ids.append(token)
    grammar = chooser.grammar if chooser is not None else None
    if grammar is not None and not grammar.terminated:
        grammar.accept(token)
        proposal.grammar_steps += 1
    return token


def copied_drafts(token_ids: list[int], sampling: bool) -> Proposal:
    """A proposal of copied (n-gram) drafts: point distributions."""
    return Proposal(list(token_ids), [None] * len(token_ids) if sampling else [], "ngram")


def _rejection_step(generator: torch.Generator, p: torch.Tensor, q: torch.Tensor | None, draft: int) -> int:
    """Speculative rejection sampling of one position: accept `draft` with min(1, p/q), else draw
    from the residual max(p - q, 0) (for a point q: p without the draft token)."""
    q_draft = 1.0 if q is None else float(q[draft])
    if float(torch.rand((), generator=generator)) * q_draft < float(p[draft]):
        return draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0
    else:
        residual = (p - q).clamp(min=0)
    total = float(residual.sum())
    return int(torch.multinomial(residual / total if total > 0 else p, 1, generator=generator))


def accept(params: SamplingParams, generator: torch.Generator | None, verify_logits: torch.Tensor,
           prefix: list[int], proposal: Proposal,
           chooser: NextTokenChooser | None = None) -> tuple[list[int], list[float], int]:
    """Accepted tokens (drafts then the full model's own), their logprobs, and the drafts kept.

    Args:
        verify_logits: `[k + 1, vocab]` full-model logits after the pending token and each draft.
        prefix: the request's tokens before the first draft.
        chooser: the request's chooser; its grammar matcher (advanced over the drafts by
            `draft_token`) is rolled back, then advanced over each accepted token.
    """
    if chooser is not None and chooser.grammar is not None:
        chooser.grammar.rollback(proposal.grammar_steps)
    tokens: list[int] = []
    logprobs: list[float] = []
    for j, draft in enumerate([*proposal.token_ids, None]):
        logp = target_logits(params, verify_logits[j], prefix + tokens, chooser).log_softmax(-1)
        if generator is None:
            choice = int(logp.argmax())
        elif draft is not None:
            choice = _rejection_step(generator, logp.exp(), proposal.draft_probs[j], draft)
        else:
            choice = int(torch.multinomial(logp.exp(), 1, generator=generator))
        tokens.append(choice)
        logprobs.append(float(logp[choice]))
        if chooser is not None:
            chooser.accept(choice)
        if draft is None or choice != draft:
            return tokens, logprobs, j
    raise AssertionError("the last position has no draft, so the loop always returns")
