"""Runners: the forward pass over a left-padded batch (see base.Runner)."""

from __future__ import annotations

from transformers import PreTrainedModel

from .base import Runner
from .transformers_runner import TransformersRunner

RUNNER_KINDS = ("auto", "fast", "transformers")


def build_runner(model: PreTrainedModel, kind: str = "auto") -> Runner:
    """The runner for a loaded model: the fast runner where it applies, else transformers'."""
    if kind not in RUNNER_KINDS:
        raise ValueError(f"runner {kind!r} is not one of {', '.join(RUNNER_KINDS)}")
    if kind == "fast":
        raise ValueError(f"no fast runner supports model_type {model.config.model_type!r}")
    return TransformersRunner(model)
