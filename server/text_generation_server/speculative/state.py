"""Verified mode: lossless self-speculative decoding with layer-skipped drafts.

Design note. For a group of rows that share a draft skip set S, one decode step is a cycle:
1. draft: k one-token forwards with S bypassed, each choosing a draft token per row (greedy:
   argmax; sampling: the warped draft distribution q raced with the position's noise);
2. crop the KV cache back to where it was, so no draft hidden state stays in it;
3. verify: one full forward over [pending token, d1..dk], which writes the true keys/values
   of all k + 1 positions;
4. accept per row the longest prefix the full model agrees with (greedy: equal argmax;
   sampling: the same race of the full model's p with the same noise chooses d_j), plus one
   token of the full model's own (the correction or the bonus);
5. mask, per row, the columns of its rejected drafts and crop the columns no row kept.
After the cycle the cache holds exactly the accepted tokens of every row, and the output equals
the full model's, greedy or sampled with a seed (up to floating-point near-ties between the
one-token and the (k+1)-token forward). Rows accept different numbers of tokens, so a row's real tokens need
not be contiguous; positions come from the mask, so attention and RoPE stay exact.
Where each step lives: 1 and 4 are token choice (`draft_token`, `accept` in
accept.py); 2, 3 and the forwards of 1 run in engine/group_step.py; 5 is
`PlanGroup.accept_drafts`. This module keeps the drafters' state and statistics.

Drafts come from two drafters in the same loop (controller.py decides per cycle): n-gram
(prompt-lookup) drafts copied from the context, free to make (ngram.py), and layer-skip drafts
from the draft model (`Runner.draft_model`: skipped layers + an optional reduced head, draft_head.py, read as int8 on
a dense model: FastRunnerConfig.draft_weights). Adaptivity
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
from typing import Protocol

from ..sampling import NextTokenChooser
from .cost_model import MAX_DRAFT, CostModel, tokens_per_cycle
from .ngram import NgramIndex, Watch

INITIAL_DRAFT = 1  # until acceptance is measured, the cheapest cycle

__all__ = ["INITIAL_DRAFT", "MAX_DRAFT", "CostModel", "Counts", "DraftingRow", "SpecState",
           "tokens_per_cycle"]


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

    def without(self, other: Counts) -> Counts:
        """These counts less another's that they include (floored at zero: pooled counts decay)."""
        return Counts(max(self.cycles - other.cycles, 0), max(self.drafted - other.drafted, 0),
                      max(self.accepted - other.accepted, 0), max(self.rejections - other.rejections, 0))

    def plus(self, other: Counts) -> Counts:
        return Counts(self.cycles + other.cycles, self.drafted + other.drafted, self.accepted + other.accepted,
                      self.rejections + other.rejections)

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
        model / ngram: this request's counts per drafter (drafted cycles only).
        watched: copies watched instead of drafted (ngram.Watch), counted as drafted cycles would be;
            `watch` is the one pending, `index` the request's n-gram index.
        auto_off: model drafting stopped for this request (it did not pay); n-gram drafts go on.
    """

    rule: str = ""
    skip: frozenset[int] = frozenset()
    vocab: int = 0
    k: int = INITIAL_DRAFT
    model: Counts = field(default_factory=Counts)
    ngram: Counts = field(default_factory=Counts)
    watched: Counts = field(default_factory=Counts)
    watch: Watch | None = None
    index: NgramIndex = field(default_factory=NgramIndex)
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


class DraftingRow(Protocol):
    """What speculation reads of a request (the engine's RequestState)."""

    all_ids: list[int]  # prompt then generated tokens
    chooser: NextTokenChooser
    spec: SpecState | None
