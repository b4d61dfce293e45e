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

Adaptivity: each request keeps acceptance counts; with a per-draft acceptance probability a,
a cycle of k drafts yields (1 - a^(k+1)) / (1 - a) tokens and costs k draft steps plus one
verification over k + 1 tokens (`CostModel`, measured at warmup). The draft length is the k
that maximises tokens per second; when even the best k is slower than plain decoding, the
request stops drafting and continues as `off` ("auto-off").

Grammar and watermark: with the request's chooser, drafts and verification positions go
through the same processors as `off` (watermark, penalties, grammar mask, warpers). Each
draft advances the grammar matcher, so the next draft is proposed under the grammar; before
verification the matcher is rolled back over every draft and then advances over the tokens
verification keeps, position by position, each position masked in the state its prefix
leaves. The matcher ends exactly past the accepted tokens, and greedy output equals `off`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..sampling import NextTokenChooser, SamplingParams, apply_penalties, apply_warpers
from .runner.base import Runner

MAX_DRAFT = 6  # the largest k; Info.speculate reports it
INITIAL_DRAFT = 1  # until acceptance is measured, the cheapest cycle
MIN_CYCLES_BEFORE_AUTO_OFF = 2


@dataclass
class SpecState:
    """A verified request's drafting statistics."""

    k: int = INITIAL_DRAFT
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    auto_off: bool = False

    @property
    def acceptance(self) -> float:
        """Per-draft acceptance probability, with a uniform prior (Laplace)."""
        return (self.accepted + 1) / (self.accepted + self.rejections + 2)

    def record(self, drafted: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += int(accepted < drafted)


@dataclass(frozen=True)
class CostModel:
    """Seconds of forwards, measured on the loaded runner at batch 1.

    Attributes:
        step_s: a full forward of one token (a plain decode step).
        verify_s: `verify_s[n - 1]` is a full forward of n tokens, n = 1 .. MAX_DRAFT + 1.
        layer_s: what bypassing one layer saves in a one-token forward.
    """

    step_s: float
    verify_s: tuple[float, ...]
    layer_s: float

    def draft_s(self, num_skipped: int) -> float:
        return max(self.step_s - self.layer_s * num_skipped, 0.05 * self.step_s)

    def speedup(self, k: int, acceptance: float, num_skipped: int) -> float:
        """Expected tokens/s of k-token drafting relative to plain decoding."""
        a = min(acceptance, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        cycle_s = k * self.draft_s(num_skipped) + self.verify_s[k]
        return tokens * self.step_s / cycle_s

    def best_k(self, acceptance: float, num_skipped: int) -> tuple[int, float]:
        speeds = {k: self.speedup(k, acceptance, num_skipped) for k in range(1, MAX_DRAFT + 1)}
        k = max(speeds, key=lambda key: speeds[key])
        return k, speeds[k]

    @classmethod
    def measure(cls, runner: Runner, repeats: int = 3, context: int = 64) -> CostModel:
        """Time full and half-skipped forwards after a `context`-token prefix (median of repeats)."""
        half = frozenset(range(1, runner.num_layers, 2))

        def timed(new: int, skip: frozenset[int]) -> float:
            times = []
            for _ in range(repeats):
                cache = runner.new_cache(1)
                ids = torch.zeros((1, context), dtype=torch.long)
                runner.forward(ids, torch.arange(context)[None], torch.ones((1, context), dtype=torch.long), cache)
                start = time.perf_counter()
                runner.forward(torch.zeros((1, new), dtype=torch.long), torch.arange(context, context + new)[None],
                               torch.ones((1, context + new), dtype=torch.long), cache, last_only=False,
                               skip_layers=skip)
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        verify = tuple(timed(n, frozenset()) for n in range(1, MAX_DRAFT + 2))
        layer_s = max(verify[0] - timed(1, half), 0.0) / len(half)
        return cls(step_s=verify[0], verify_s=verify, layer_s=layer_s)


@dataclass
class Proposal:
    """One row's drafts: token ids and the draft distributions they came from."""

    token_ids: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # each [vocab] (sampling only)
    grammar_steps: int = 0  # drafts the grammar matcher advanced over (none once it terminated)


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
                prefix: list[int], proposal: Proposal, chooser: NextTokenChooser | None = None) -> int:
    """Choose one draft token (greedy argmax, or a draw from the warped draft distribution);
    with a chooser that has a grammar, the matcher advances over it (`accept` rolls it back)."""
    warped = target_logits(params, logits, prefix, chooser)
    if generator is None:
        token = int(warped.argmax())
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
            q = proposal.draft_probs[j]
            p = logp.exp()
            if float(torch.rand((), generator=generator)) * float(q[draft]) < float(p[draft]):
                choice = draft
            else:
                residual = (p - q).clamp(min=0)
                total = float(residual.sum())
                choice = int(torch.multinomial(residual / total if total > 0 else p, 1, generator=generator))
        else:
            choice = int(torch.multinomial(logp.exp(), 1, generator=generator))
        tokens.append(choice)
        logprobs.append(float(logp[choice]))
        if chooser is not None:
            chooser.accept(choice)
        if draft is None or choice != draft:
            return tokens, logprobs, j
    raise AssertionError("the last position has no draft, so the loop always returns")
