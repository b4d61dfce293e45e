"""Speculative token choice: drafting a token, and accepting drafts against the full model.

Every position is chosen as plain decoding chooses it (chooser.py), so the drafts change how
many positions one full forward decides, never which tokens come out. Greedy: a draft is the
draft model's argmax and is kept while it equals the full model's argmax. Sampling: the draft
at position t is `argmax(q / E_t)`, with the warped draft distribution q and the same noise E_t
that chooses the full model's token `argmax(p / E_t)` there, and it is kept when the two are
equal. The output is the full model's own draw under the request's seed, token for token, and
follows p exactly; a draft whose q is close to p picks the same token under the same noise
(the coupling accepts at least (1 - TV) / (1 + TV) of drafts, where speculative rejection
sampling accepts 1 - TV, TV the total variation distance between p and q, but its tokens would
depend on the drafts). Copied (n-gram) drafts are kept when the full model's draw is the copied
token, with probability p(d) either way. Both positions go through the request's own processors
(the chooser: watermark, penalties, grammar mask, warpers), as plain decoding does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..sampling.chooser import NextTokenChooser, SamplingParams, apply_penalties, apply_warpers, position_noise, race
from .draft_head import DraftHead


@dataclass
class Proposal:
    """One row's drafts: token ids, and under sampling the noise each model draft was raced with.

    `noise[j]` is E_t of draft j's position (`accept` races the full model's p with it again);
    copied (n-gram) drafts have none, `accept` draws it.
    """

    token_ids: list[int] = field(default_factory=list)
    noise: list[torch.Tensor] = field(default_factory=list)
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


def _warps_only(params: SamplingParams, chooser: NextTokenChooser | None) -> bool:
    """No processor but the warpers (`NextTokenChooser.warps_only`; without a chooser: no penalty)."""
    return not params.has_penalties and (chooser is None or chooser.warps_only)


def draft_token(params: SamplingParams, logits: torch.Tensor, prefix: list[int], proposal: Proposal,
                head: DraftHead | None = None, vocab_size: int = 0, chooser: NextTokenChooser | None = None) -> int:
    """Choose one draft token (greedy argmax, or the race of the warped draft distribution with
    the position's noise); with a chooser that has a grammar, the matcher advances over it
    (`accept` rolls it back).

    Args:
        logits: `[vocab]`, or `[head.size]` when the draft ran a reduced head.
        prefix: the request's tokens before this draft (prompt, generated, earlier drafts).
        head / vocab_size: the reduced head and the full vocabulary size (q is zero outside the
            head's ids; penalties, grammar masks and the watermark take the full-vocabulary form).
    """
    warps_only = _warps_only(params, chooser)
    if head is not None and warps_only and not params.sampling:
        token = int(head.to_ids(logits.max(-1).indices))
    elif head is not None and warps_only:
        # q is zero outside the head's ids and the warpers act on q alone: the race over the head's
        # words is the full vocabulary's (the noise is drawn whole: `accept` races p with it)
        proposal.noise.append(position_noise(params.seed, len(prefix), vocab_size))
        warped = apply_warpers(logits, params) if params.has_warpers else logits
        token = int(head.token_ids[race(warped.log_softmax(-1), proposal.noise[-1][head.token_ids])])
    else:
        full = head.to_full(logits, vocab_size) if head is not None else logits
        warped = target_logits(params, full, prefix, chooser)
        if params.sampling:
            proposal.noise.append(position_noise(params.seed, len(prefix), warped.shape[-1]))
        if params.sampling and float(warped.max()) > -math.inf:
            token = race(warped.log_softmax(-1), proposal.noise[-1])
        else:  # greedy, or a grammar allows none of the head's words (the draft will not be kept)
            token = int(warped.max(-1).indices)
    proposal.token_ids.append(token)
    grammar = chooser.grammar if chooser is not None else None
    if grammar is not None and not grammar.terminated:
        grammar.accept(token)
        proposal.grammar_steps += 1
    return token


def copied_drafts(token_ids: list[int]) -> Proposal:
    """A proposal of copied (n-gram) drafts."""
    return Proposal(list(token_ids), source="ngram")


def accept(params: SamplingParams, verify_logits: torch.Tensor, prefix: list[int], proposal: Proposal,
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
    plain = not params.sampling and _warps_only(params, chooser)
    if plain:  # no processor: every position's choice from one batched log-softmax (its rows are the
        # per-position ones bit for bit, and cheaper than one call per position)
        values, ids = verify_logits.log_softmax(-1).max(-1)
        best, best_logprobs = ids.tolist(), values.tolist()
    for j, draft in enumerate([*proposal.token_ids, None]):
        if plain:
            choice, logprob = best[j], best_logprobs[j]
        else:
            logp = target_logits(params, verify_logits[j], prefix + tokens, chooser).log_softmax(-1)
            if params.sampling:
                noise = (proposal.noise[j] if j < len(proposal.noise)
                         else position_noise(params.seed, len(prefix) + j, logp.shape[-1]))
                choice = race(logp, noise)
            else:
                choice = int(logp.max(-1).indices)
            logprob = float(logp[choice])
        tokens.append(choice)
        logprobs.append(logprob)
        if chooser is not None:
            chooser.accept(choice)
        if draft is None or choice != draft:
            return tokens, logprobs, j
    raise AssertionError("the last position has no draft, so the loop always returns")
