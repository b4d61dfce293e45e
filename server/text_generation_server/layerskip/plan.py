"""SkipPlan: the per-request decision, a frozen value passed explicitly to whoever runs layers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from .draft import DraftSettings


class LayerSkipMode(StrEnum):
    """A request's layer-skip mode. The values are the CLI's, the policy files' and the wire's;
    being strings, members compare equal to them."""

    OFF = "off"
    SHADOW = "shadow"  # the plan is decided and reported; nothing is bypassed
    LOSSY = "lossy"  # the plan's layers are bypassed in every forward
    VERIFIED = "verified"  # bypassed in draft forwards only, then verified by the full model


MODES = tuple(m.value for m in LayerSkipMode)
# Modes in which the plan's layers are bypassed in the (draft) forward.
APPLYING_MODES = (LayerSkipMode.LOSSY, LayerSkipMode.VERIFIED)


def check_mode(mode: str) -> str:
    """Return `mode` if it is one of MODES, else raise a ValueError naming it."""
    if mode not in MODES:
        raise ValueError(f"layer skip mode {mode!r} is not known; use one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True)
class SkipPlan:
    """Which decoder layers one request bypasses, decided once at prefill.

    Attributes:
        mode: one of MODES. In "off" and "shadow" nothing is bypassed; "shadow" still carries
            the layers the decider chose, for reporting. "lossy" bypasses `skipped` for the
            whole request; "verified" bypasses them in draft forwards only.
        skipped: indices (in the loaded model's decoder layer list) the decider chose.
        rule: name of the rule that fired ("" when no decider ran).
        scores: the detector scores and features the rule saw.
        allow_protected: whether layer 0 and the last layer may be in `skipped`.
        draft: verified mode's draft settings of the rule that fired (reduced head size and
            calibrated acceptance); the default drafts with the full head.
    """

    mode: str = LayerSkipMode.OFF
    skipped: frozenset[int] = frozenset()
    rule: str = ""
    scores: Mapping[str, float] = field(default_factory=dict)
    allow_protected: bool = False
    draft: DraftSettings = field(default_factory=DraftSettings)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        object.__setattr__(self, "skipped", frozenset(int(i) for i in self.skipped))
        negative = sorted(i for i in self.skipped if i < 0)
        if negative:
            raise ValueError(f"skipped layers {negative} are negative; layer indices start at 0")
        if 0 in self.skipped and not self.allow_protected:
            raise ValueError("layer 0 is protected; only a policy with allow_protected may skip it")
        if self.mode == LayerSkipMode.OFF and self.skipped:
            raise ValueError(f"mode 'off' cannot carry skipped layers {sorted(self.skipped)}")

    @staticmethod
    def off() -> SkipPlan:
        return SkipPlan()

    @property
    def applied(self) -> frozenset[int]:
        """The layers actually bypassed in this plan's (draft) forward."""
        return self.skipped if self.mode in APPLYING_MODES else frozenset()

    def check_layers(self, num_layers: int) -> None:
        """Raise ValueError if `skipped` does not fit a model of `num_layers` layers."""
        out_of_range = sorted(i for i in self.skipped if i >= num_layers)
        if out_of_range:
            raise ValueError(f"skipped layers {out_of_range} are out of range for a model "
                             f"with {num_layers} layers")
        if num_layers - 1 in self.skipped and not self.allow_protected:
            raise ValueError(f"the last layer ({num_layers - 1}) is protected; only a policy "
                             "with allow_protected may skip it")

    def layers_to_run(self, num_layers: int) -> tuple[int, ...]:
        """Indices of the layers that run, in order (all of them unless the plan applies)."""
        self.check_layers(num_layers)
        return tuple(i for i in range(num_layers) if i not in self.applied)

    def bitmask(self, num_layers: int) -> np.ndarray:
        """int32 [num_layers]: 1 where the layer runs, 0 where it is bypassed."""
        mask = np.ones(num_layers, dtype=np.int32)
        self.check_layers(num_layers)
        for index in self.applied:
            mask[index] = 0
        return mask

    def to_json(self) -> dict[str, object]:
        """The reporting form (`details.layer_skip`)."""
        out: dict[str, object] = {"mode": self.mode, "skipped_layers": sorted(self.skipped), "rule": self.rule,
                                  "scores": dict(self.scores)}
        if not self.draft.is_default:
            out["draft"] = self.draft.to_json()
        return out
