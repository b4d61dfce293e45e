"""Verified mode: lossless self-speculative decoding with layer-skipped drafts.

Design note. For a group of rows that share a draft skip set S, one decode step is a cycle:
1. draft: k one-token forwards with S bypassed, each choosing a draft token per row (greedy:
   argmax; sampling: drawn from the warped draft distribution q);
2. crop the KV cache back to where it was, so no draft hidden state stays in it;
3. verify: one full forward over [pending token, d1..dk], which writes the true keys/values
   of all k + 1 positions;
4. accept per row the longest prefix the full model agrees with (greedy: equal argmax;
   sampling: accept d_j with probability min(1, p(d_j) / q(d_j)), else draw from the residual
   max(p - q, 0)), plus one token of the full model's own (the correction or the bonus);
5. mask, per row, the columns of its rejected drafts and crop the columns no row kept.
After the cycle the cache holds exactly the accepted tokens of every row, and the greedy
output equals the full model's (up to floating-point near-ties between the one-token and the
(k+1)-token forward). Rows accept different numbers of tokens, so a row's real tokens need
not be contiguous; positions come from the mask, so attention and RoPE stay exact.

Drafts come from two drafters in the same loop (draft_control.py decides per cycle): n-gram
(prompt-lookup) drafts copied from the context, free to make (ngram.py), and layer-skip drafts
from the draft model (skipped layers + an optional reduced head, draft_head.py). Adaptivity
(draft length, per-rule switch-off, per-request auto-off) is arithmetic on the measured cost
model (cost_model.py) and the measured acceptance.

Grammar and watermark: with the request's chooser, model drafts and verification positions go
through the same processors as `off` (watermark, penalties, grammar mask, warpers). Each model
draft advances the grammar matcher, so the next draft is proposed under the grammar; before
verification the matcher is rolled back over every draft and then advances over the tokens
verification keeps, position by position, each position masked in the state its prefix
leaves. Copied (n-gram) drafts do not move the matcher: one the grammar forbids is simply
rejected at its masked position. The matcher ends exactly past the accepted tokens, and greedy
output equals `off`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import NextTokenChooser, SamplingParams, apply_penalties, apply_warpers
from .cost_model import MAX_DRAFT, CostModel, tokens_per_cycle
from .draft_head import DraftHead

INITIAL_DRAFT = 1  # until acceptance is measured, the cheapest cycle
MIN_CYCLES_BEFORE_AUTO_OFF = 2

__all__ = ["INITIAL_DRAFT", "MAX_DRAFT", "MIN_CYCLES_BEFORE_AUTO_OFF", "CostModel", "Counts", "Proposal", "SpecState",
           "accept", "copied_drafts", "draft_token", "tokens_per_cycle"]


@dataclass
class Counts:
    """Drafts proposed and kept by one drafter (per request, or per rule across requests)."""

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += int(accepted < drafted)

    def estimate(self, prior: float, weight: float = 2.0) -> float:
        """Per-draft acceptance (geometric model: each accepted draft a success, each cycle that
        stopped early a failure), with `weight` pseudo-observations at `prior`."""
        return (self.accepted + prior * weight) / (self.accepted + self.rejections + weight)


@dataclass
class SpecState:
    """A speculating request's drafters and statistics.

    Attributes:
        rule: the plan's rule (per-rule acceptance is pooled under it).
        skip / vocab: the draft model (layers bypassed, reduced head size; 0 = full head);
            an empty skip set means n-gram drafts only.
        k: the model-draft length of the last cycle.
        model / ngram: this request's counts per drafter.
        auto_off: model drafting stopped for this request (it did not pay); n-gram drafts go on.
    """

    rule: str = ""
    skip: frozenset[int] = frozenset()
    vocab: int = 0
    k: int = INITIAL_DRAFT
    model: Counts = field(default_factory=Counts)
    ngram: Counts = field(default_factory=Counts)
    auto_off: bool = False

    @property
    def model_drafting(self) -> bool:
        return bool(self.skip) and not self.auto_off

    @property
    def cycles(self) -> int:
        return self.model.cycles + self.ngram.cycles

    @property
    def drafted(self) -> int:
        return self.model.drafted + self.ngram.drafted

    @property
    def accepted(self) -> int:
        return self.model.accepted + self.ngram.accepted

    @property
    def acceptance(self) -> float:
        """Per-draft acceptance of the model drafts, with a uniform prior (Laplace)."""
        return self.model.estimate(0.5)


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
