"""SkipPlan: a frozen, validated value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from text_generation_server.layerskip import MODES, SkipPlan


def test_modes() -> None:
    assert MODES == ("off", "shadow", "lossy", "verified")


def test_layers_to_run_and_bitmask() -> None:
    plan = SkipPlan(mode="lossy", skipped=frozenset({2, 5}), rule="r")
    assert plan.layers_to_run(8) == (0, 1, 3, 4, 6, 7)
    np.testing.assert_array_equal(plan.bitmask(8), np.array([1, 1, 0, 1, 1, 0, 1, 1], dtype=np.int32))
    assert plan.bitmask(8).dtype == np.int32
    assert SkipPlan.off().layers_to_run(3) == (0, 1, 2)
    assert plan.to_json() == {"mode": "lossy", "skipped_layers": [2, 5], "rule": "r", "scores": {}}


def test_plan_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SkipPlan().mode = "lossy"  # type: ignore[misc]


def test_protected_and_out_of_range_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="layer 0 is protected"):
        SkipPlan(mode="lossy", skipped=frozenset({0}))
    with pytest.raises(ValueError, match="last layer \\(7\\) is protected"):
        SkipPlan(mode="lossy", skipped=frozenset({7})).layers_to_run(8)
    with pytest.raises(ValueError, match="\\[9\\] are out of range for a model with 8 layers"):
        SkipPlan(mode="lossy", skipped=frozenset({9})).bitmask(8)
    with pytest.raises(ValueError, match="negative"):
        SkipPlan(mode="lossy", skipped=frozenset({-1}))
    with pytest.raises(ValueError, match="mode 'off' cannot carry"):
        SkipPlan(mode="off", skipped=frozenset({3}))
    with pytest.raises(ValueError, match="mode 'fast' is not known"):
        SkipPlan(mode="fast")
    edges = SkipPlan(mode="lossy", skipped=frozenset({0, 7}), allow_protected=True)
    assert edges.layers_to_run(8) == tuple(range(1, 7))
