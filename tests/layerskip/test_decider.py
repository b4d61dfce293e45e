"""Decider: ordered rules, first match wins, default otherwise; mode semantics of plans."""

from __future__ import annotations

import pytest

from text_generation_server.layerskip import Condition, DetectorScores, Rule, RuleTable

SCORES = DetectorScores(num_tokens=12, max_score=0.8, mean_score=0.5, spectral_entropy=0.9, kurtosis=1.0)


def _table(**kwargs: object) -> RuleTable:
    return RuleTable((
        Rule("long", (Condition("num_tokens", ">=", 100),), frozenset({5})),
        Rule("calm", (Condition("max_score", "<", 1.0), Condition("kurtosis", "<=", 2.0)), frozenset({3, 4})),
        Rule("also-calm", (Condition("max_score", "<", 1.0),), frozenset({6})),
    ), Rule("default", (), frozenset({2})), num_layers=10, **kwargs)  # type: ignore[arg-type]


def test_first_matching_rule_wins() -> None:
    plan = _table().decide(SCORES, "lossy")
    assert (plan.rule, plan.skipped, plan.mode) == ("calm", frozenset({3, 4}), "lossy")
    assert plan.scores["max_score"] == 0.8


def test_default_fires_when_nothing_matches() -> None:
    busy = DetectorScores(num_tokens=12, max_score=1.5, mean_score=0.5, spectral_entropy=0.9, kurtosis=1.0)
    plan = _table().decide(busy, "lossy")
    assert (plan.rule, plan.skipped) == ("default", frozenset({2}))


def test_off_gives_the_empty_plan_and_shadow_applies_nothing() -> None:
    table = _table()
    assert table.decide(SCORES, "off").skipped == frozenset()
    shadow = table.decide(SCORES, "shadow")
    assert shadow.skipped == frozenset({3, 4}) and shadow.applied == frozenset()
    assert shadow.layers_to_run(10) == tuple(range(10))


def test_bad_rules_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match="feature 'loudness'"):
        Condition("loudness", "<", 1.0)
    with pytest.raises(ValueError, match="operator '=='"):
        Condition("max_score", "==", 1.0)
    with pytest.raises(ValueError, match="rule 'x' skips layers \\[12\\], out of range for 10 layers"):
        RuleTable((Rule("x", (), frozenset({12})),), Rule("default"), 10)
    with pytest.raises(ValueError, match="rule 'x' skips protected layers \\[0, 9\\]"):
        RuleTable((Rule("x", (), frozenset({0, 9})),), Rule("default"), 10)
    with pytest.raises(ValueError, match="used twice"):
        RuleTable((Rule("default"),), Rule("default"), 10)
    with pytest.raises(ValueError, match="has conditions"):
        RuleTable((), Rule("default", (Condition("max_score", "<", 1.0),)), 10)
    with pytest.raises(ValueError, match="mode 'fast' is not known"):
        _table().decide(SCORES, "fast")


def test_allow_protected_permits_the_first_and_last_layer() -> None:
    table = RuleTable((Rule("edges", (), frozenset({0, 9})),), Rule("default"), 10, allow_protected=True)
    assert table.decide(SCORES, "lossy").layers_to_run(10) == tuple(range(1, 9))
