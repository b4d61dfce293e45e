"""Per-prompt trials: each prompt's greedy output and teacher-forced agreement under nested skip sets.

The sweep, calibrate and verify commands all reduce to the same measurement: for a prompt and a
skip set, does the greedy continuation equal `off`, where does it first diverge, and which
share of the teacher-forced next-token choices (over `off`'s continuation) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from text_generation_server.layerskip import DetectorConfig, DetectorScores, detect

from .engine import NO_SKIP, Engine, Skip, teacher_forced
from .output import progress
from .prompts import Prompt


@dataclass(frozen=True)
class Outcome:
    """One prompt under one skip set, compared with `off`.

    Attributes:
        exact: the greedy continuation equals off's (token for token, up to EOS or the limit).
        first_divergence: index of the first differing token, None when exact.
        tf_agreement: share of teacher-forced positions whose argmax is unchanged.
    """

    exact: bool
    first_divergence: int | None
    tf_agreement: float

    @staticmethod
    def same() -> Outcome:
        return Outcome(True, None, 1.0)

    def to_json(self) -> dict[str, Any]:
        return {"exact": self.exact, "first_divergence": self.first_divergence, "tf_agreement": self.tf_agreement}


@dataclass
class PromptTrial:
    """A prompt, its detector scores, off's continuation and the outcomes per skip depth k."""

    prompt: Prompt
    scores: DetectorScores
    off_tokens: tuple[int, ...]
    outcomes: dict[int, Outcome] = field(default_factory=dict)

    @property
    def safe_depth(self) -> int:
        """The largest k such that every depth 1..k still gives off's greedy output."""
        depth = 0
        while depth + 1 in self.outcomes and self.outcomes[depth + 1].exact:
            depth += 1
        return depth

    def to_json(self) -> dict[str, Any]:
        return {"id": self.prompt.id, "category": self.prompt.category, "split": self.prompt.split,
                "scores": self.scores.as_dict(), "off_tokens": list(self.off_tokens),
                "safe_depth": self.safe_depth, "outcomes": {str(k): o.to_json() for k, o in self.outcomes.items()}}


def compare(engine: Engine, ids: torch.Tensor, off_tokens: tuple[int, ...], skip: Skip,
            reference_logits: torch.Tensor | None = None) -> Outcome:
    """Greedy (stopping one token after divergence) and teacher-forced comparison of `skip` against off."""
    if not skip:
        return Outcome.same()
    tokens = engine.greedy(ids, skip, len(off_tokens), reference=off_tokens)
    diverged = next((i for i, (a, b) in enumerate(zip(tokens, off_tokens, strict=False)) if a != b), None)
    if diverged is None and len(tokens) != len(off_tokens):
        diverged = min(len(tokens), len(off_tokens))
    candidate, reference = teacher_forced(engine, ids, off_tokens, reference_logits, skip)
    agreement = float((candidate.argmax(-1) == reference.argmax(-1)).double().mean())
    return Outcome(diverged is None, diverged, agreement)


def run_trials(engine: Engine, prompts: list[Prompt], skip_sets: list[Skip], new_tokens: int,
               detector: DetectorConfig, label: str) -> list[PromptTrial]:
    """Off's continuation and the outcome of each nested skip set (depth k = position + 1) per prompt."""
    trials = []
    for prompt in progress(prompts, label):
        ids = prompt.render(engine.tokenizer)
        off = engine.greedy(ids, NO_SKIP, new_tokens)
        full = torch.cat([ids, torch.tensor(off, dtype=torch.long)])
        reference = engine.logits(full)[ids.shape[0] - 1: ids.shape[0] - 1 + len(off)]
        trial = PromptTrial(prompt, detect(engine.embed(ids), detector), off)
        for k, skip in enumerate(skip_sets, 1):
            trial.outcomes[k] = compare(engine, ids, off, skip, reference)
        trials.append(trial)
    return trials
