"""Policy files for tests, written with the layerskip library from a loaded model."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from text_generation_server.layerskip import (
    Condition,
    DraftSettings,
    DraftVocab,
    IdentityMap,
    Policy,
    Rule,
    RuleTable,
    save_policy,
)

# Six of the default model's 30 layers, away from the critical ones (0, 1, 11, 28, 29).
SIX_LAYERS = frozenset({4, 7, 14, 18, 21, 24})
TWO_LAYERS = frozenset({14, 18})
SHORT_PROMPT_TOKENS = 8.0
# A prompt that fires write_policy's default rule, and one under SHORT_PROMPT_TOKENS tokens.
LONG_PROMPT = "Explain in a few sentences why the sky is blue during the day and red at sunset."
SHORT_PROMPT = "Hello there"


def write_policy(model: nn.Module, path: Path, default_skip: frozenset[int] = SIX_LAYERS,
                 short_skip: frozenset[int] | None = None, draft: DraftSettings = DraftSettings(),
                 draft_vocab: DraftVocab | None = None) -> Path:
    """A policy for `model`: prompts under SHORT_PROMPT_TOKENS tokens skip `short_skip` (when
    given), every other prompt skips `default_skip`; every rule drafts with `draft`."""
    identity = IdentityMap.from_model(model)
    rules = () if short_skip is None else (
        Rule("short", (Condition("num_tokens", "<", SHORT_PROMPT_TOKENS),), short_skip, draft),)
    table = RuleTable(rules, Rule("default", (), default_skip, draft), identity.num_layers)
    objective = "verified" if draft_vocab is not None else "lossy"
    return save_policy(Policy.from_table(identity, table, objective=objective, draft_vocab=draft_vocab), path)
