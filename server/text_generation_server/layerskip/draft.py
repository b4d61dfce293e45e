"""Draft settings of verified mode: what a rule's draft model is, beyond its skipped layers.

Design note (the draft model). In verified mode a rule's draft model is the loaded model with
the rule's layers bypassed and, optionally, a reduced output head: the lm_head rows of the
first `vocab` token ids of the policy's frequency ranking (`DraftVocab`). On small models with
large vocabularies (Qwen2.5-Coder's 151936 words) the head is a large share of the weight bytes
a step reads, so a draft that keeps the full head stays expensive however many layers it skips.
The reduced head is lossless for the same reason skipped layers are: verification runs the full
model with the full head, so a token outside the subset is simply never proposed, and every
emitted token is the full model's own choice (greedy, or its draw under the request's seed:
speculative/accept.py).

Vocabulary selection: `layerskip calibrate --objective verified` counts the tokens of the
calibration text (the prompts and the full model's greedy continuations) and ranks them by
count; the ids never seen follow in ascending id order (byte-level BPE ids are in merge order,
so low ids are the frequent ones). The EOS ids are always ranked first. A rule names how many
of the ranked ids its head keeps; the calibration chooses that size by expected speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftSettings:
    """A rule's draft settings (verified mode).

    Attributes:
        vocab: 0 drafts with the full lm_head; N > 0 with the first N ids of the policy's
            `DraftVocab` ranking.
        acceptance: the per-draft acceptance measured for this rule at calibration (the prior
            of the serve-time estimate); None when unknown.
    """

    vocab: int = 0
    acceptance: float | None = None

    def __post_init__(self) -> None:
        if int(self.vocab) < 0:
            raise ValueError(f"draft vocab={self.vocab}: use 0 (the full head) or a positive size")
        object.__setattr__(self, "vocab", int(self.vocab))
        if self.acceptance is not None and not 0.0 <= float(self.acceptance) <= 1.0:
            raise ValueError(f"draft acceptance={self.acceptance}: use a fraction in [0, 1]")

    @property
    def is_default(self) -> bool:
        return self.vocab == 0 and self.acceptance is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"vocab": self.vocab}
        if self.acceptance is not None:
            out["acceptance"] = self.acceptance
        return out

    @staticmethod
    def from_json(data: Any) -> DraftSettings:
        if not isinstance(data, Mapping):
            raise ValueError(f"a rule's draft must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"vocab", "acceptance"})
        if unknown:
            raise ValueError(f"a rule's draft has unknown fields {unknown}; use vocab, acceptance")
        acceptance = data.get("acceptance")
        return DraftSettings(int(data.get("vocab", 0)), None if acceptance is None else float(acceptance))


@dataclass(frozen=True)
class DraftVocab:
    """Token ids ranked for reduced draft heads, most useful first (see module docstring).

    Attributes:
        token_ids: distinct ids; a rule with `vocab = N` drafts over the first N.
        source: how the ranking was measured (data set, token count).
    """

    token_ids: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.token_ids)
        object.__setattr__(self, "token_ids", ids)
        if not ids:
            raise ValueError("draft_vocab.token_ids is empty; omit draft_vocab instead")
        negative = [i for i in ids if i < 0]
        if negative:
            raise ValueError(f"draft_vocab holds negative token ids {negative[:5]}")
        if len(set(ids)) != len(ids):
            seen: set[int] = set()
            twice = [i for i in ids if i in seen or seen.add(i)]  # type: ignore[func-returns-value]
            raise ValueError(f"draft_vocab lists token ids {twice[:5]} more than once")

    def check(self, vocab_size: int) -> None:
        """ValueError naming the ids that a model with `vocab_size` words does not have."""
        bad = [i for i in self.token_ids if i >= vocab_size]
        if bad:
            raise ValueError(f"draft_vocab names token ids {bad[:5]} beyond the model's vocabulary of "
                             f"{vocab_size}: it was made for another tokenizer")

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "token_ids": list(self.token_ids)}

    @staticmethod
    def from_json(data: Any) -> DraftVocab:
        if not isinstance(data, Mapping) or not isinstance(data.get("token_ids"), list):
            raise ValueError("draft_vocab must be an object with a token_ids list")
        return DraftVocab(tuple(int(i) for i in data["token_ids"]), str(data.get("source", "")))
