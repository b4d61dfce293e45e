"""The draft controller's knobs, in one frozen value passed to it (controller.py says how each is used).

Why each value is what it is, with the measurements behind it: docs/tuning.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class DraftTuning:
    """Bars, priors and counts of draft control.

    Attributes:
        min_gain: a one-row cycle (and any cycle of copies) drafts only when its expected speed
            beats a plain step by this factor: a margin over the warm-up cost model's noise.
        min_gain_rows: the same bar for model drafts in groups of several rows, by "dtype/kernels"
            then "dtype" (multi-row prices move more between warm-ups than one-row ones).
        min_gain_rows_other: the multi-row bar of any other dtype.
        learn_floor: a row with fewer than `request_prior_weight` drafts of its own still drafts
            when its cycle is predicted within this factor of plain decoding (its own acceptance
            then decides, not the prior alone).
        request_prior_weight: the rule's estimate counts as this many drafts of a request.
        rule_prior_weight: the policy's calibrated acceptance counts as this many drafts of a rule.
        min_rule_cycles: cycles before a rule's pooled acceptance may switch its drafting off.
        probe_every: a switched-off rule still drafts one new request in this many.
        decay_at: a rule's pooled counts are halved past this many cycles.
        unknown_prior: acceptance assumed for a rule without a calibrated one.
        ngram_prior: acceptance assumed for copied (n-gram) drafts.
        min_cycles_before_auto_off: a request's own cycles before its drafting may stop.
    """

    min_gain: float = 1.05
    min_gain_rows: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({"float32": 1.15, "bfloat16/amx": 1.15}))
    min_gain_rows_other: float = 1.25
    learn_floor: float = 0.95
    request_prior_weight: float = 4.0
    rule_prior_weight: float = 16.0
    min_rule_cycles: int = 16
    probe_every: int = 16
    decay_at: int = 512
    unknown_prior: float = 0.6
    ngram_prior: float = 0.5
    min_cycles_before_auto_off: int = 2

    def rows_bar(self, dtype: str, kernels: str) -> float:
        """The multi-row bar of a runner: its dtype on its kernels, else its dtype, else the default."""
        return self.min_gain_rows.get(f"{dtype}/{kernels}", self.min_gain_rows.get(dtype, self.min_gain_rows_other))
