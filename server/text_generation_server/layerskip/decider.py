"""Decider: an ordered rule table from detector scores to a SkipPlan; first match wins.

No learned model: each rule is a conjunction of threshold conditions on the detector's
features, and names the layers (run-time indices, after alignment) to bypass. The default
rule has no conditions and fires when nothing else does.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .detector import FEATURES, DetectorScores
from .draft import DraftSettings
from .plan import LayerSkipMode, SkipPlan, check_mode

OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


@dataclass(frozen=True)
class Condition:
    """`feature op value`, e.g. ("max_score", "<", 0.8)."""

    feature: str
    op: str
    value: float

    def __post_init__(self) -> None:
        if self.feature not in FEATURES:
            raise ValueError(f"condition feature {self.feature!r} is not known; use one of {', '.join(FEATURES)}")
        if self.op not in OPS:
            raise ValueError(f"condition operator {self.op!r} is not known; use one of {' '.join(OPS)}")
        object.__setattr__(self, "value", float(self.value))

    def holds(self, features: Mapping[str, float]) -> bool:
        return OPS[self.op](features[self.feature], self.value)

    def to_json(self) -> dict[str, Any]:
        return {"feature": self.feature, "op": self.op, "value": self.value}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Condition:
        return Condition(str(data["feature"]), str(data["op"]), float(data["value"]))


@dataclass(frozen=True)
class Rule:
    """When all `conditions` hold, bypass `skip` (layer indices of the loaded model); in verified
    mode, draft with `draft`'s settings."""

    name: str
    conditions: tuple[Condition, ...] = ()
    skip: frozenset[int] = frozenset()
    draft: DraftSettings = DraftSettings()

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("every rule needs a non-empty name (it is reported with each plan)")
        object.__setattr__(self, "conditions", tuple(self.conditions))
        object.__setattr__(self, "skip", frozenset(int(i) for i in self.skip))

    def matches(self, features: Mapping[str, float]) -> bool:
        return all(condition.holds(features) for condition in self.conditions)


@dataclass(frozen=True)
class RuleTable:
    """Ordered rules and a default; `decide` returns the first matching rule's plan.

    Attributes:
        rules: tried in order.
        default: fires when no rule matches; it must have no conditions.
        num_layers: layers of the loaded model (skip sets are checked against it).
        allow_protected: whether rules may skip layer 0 and the last layer.
    """

    rules: tuple[Rule, ...]
    default: Rule
    num_layers: int
    allow_protected: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        if self.default.conditions:
            raise ValueError(f"default rule {self.default.name!r} has conditions; a default has none")
        names = [rule.name for rule in (*self.rules, self.default)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"rule names {duplicates} are used twice; give each rule its own name")
        for rule in (*self.rules, self.default):
            self._check_skip(rule)

    def _check_skip(self, rule: Rule) -> None:
        bad = sorted(i for i in rule.skip if not 0 <= i < self.num_layers)
        if bad:
            raise ValueError(f"rule {rule.name!r} skips layers {bad}, out of range for "
                             f"{self.num_layers} layers")
        protected = sorted(rule.skip & {0, self.num_layers - 1})
        if protected and not self.allow_protected:
            raise ValueError(f"rule {rule.name!r} skips protected layers {protected} (the first and "
                             "last layer); set allow_protected in the policy to permit it")

    @staticmethod
    def empty(num_layers: int) -> RuleTable:
        """A table that never skips anything."""
        return RuleTable((), Rule("default"), num_layers)

    def decide(self, scores: DetectorScores, mode: str) -> SkipPlan:
        """The first matching rule's plan in `mode` ("off" always gives the empty plan)."""
        check_mode(mode)
        if mode == LayerSkipMode.OFF:
            return SkipPlan.off()
        features = scores.as_dict()
        rule = next((r for r in self.rules if r.matches(features)), self.default)
        return SkipPlan(mode=mode, skipped=rule.skip, rule=rule.name, scores=features,
                        allow_protected=self.allow_protected, draft=rule.draft)


def rules_from_json(items: Sequence[Mapping[str, Any]],
                    resolve: Callable[[str, Any], frozenset[int]]) -> tuple[Rule, ...]:
    """Rules from their JSON form; `resolve(rule_name, skip_entry)` turns layer refs into indices."""
    rules = []
    for item in items:
        name = str(item["name"])
        conditions = tuple(Condition.from_json(c) for c in item.get("when", []))
        draft = DraftSettings.from_json(item["draft"]) if "draft" in item else DraftSettings()
        rules.append(Rule(name, conditions, resolve(name, item.get("skip", [])), draft))
    return tuple(rules)
