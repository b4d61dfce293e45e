"""The plan stage of a step: detector -> decider for each new request, once, at prefill.

It wraps the layerskip library's `Scheduler` (the same object users embed) with the server's
configuration: the default mode, the policy file, and what to do when the policy is refused.
A refused policy never leaves skipping half-on: the shard either exits (the default) or, with
`--layer-skip-on-bad-policy off`, serves every request with skipping off and says so in its
logs and in Info (`layer_skip_policy_state = "refused"`). A policy that the online audit
checks find inconsistent is rolled back the same way (`"rolled_back"`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import StrEnum

import torch
from loguru import logger
from torch import nn

from ..layerskip import LayerSkipMode, Scheduler, SkipPlan
from ..layerskip.plan import MODES
from ..models.shipped_policies import AUTO, find_shipped_policy, policy_dir
from .audit_check import AuditConfig, AuditMonitor
from .batch import RequestState

DEFAULT_CONSISTENCY_TARGET = 0.9  # when neither a flag nor the policy's calibration gives one

BAD_POLICY_ACTIONS = ("exit", "off")


class PolicyState(StrEnum):
    """The served policy's state (Info's layer_skip_policy_state: the values are the wire's)."""

    NONE = "none"  # no policy: the decider never skips a layer
    LOADED = "loaded"
    REFUSED = "refused"  # refused at start, served with skipping off (--layer-skip-on-bad-policy off)
    ROLLED_BACK = "rolled_back"  # the audit checks found it inconsistent: skipping off for new requests


@dataclass(frozen=True)
class LayerSkipConfig:
    """Server-wide layer-skip settings.

    Attributes:
        mode: the default mode of requests that do not override it.
        policy_path: a policy JSON file, or "auto" (the shipped policy that matches the model,
            see shipped_policies.py); without one the decider never skips a layer.
        on_bad_policy: "exit" refuses to start with a bad policy; "off" serves with skipping off.
        audit: online audit checks of lossy requests (see audit_check.py).
    """

    mode: str = LayerSkipMode.OFF
    policy_path: str | None = None
    on_bad_policy: str = "exit"
    audit: AuditConfig = field(default_factory=AuditConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--layer-skip-mode {self.mode} is not one of {', '.join(MODES)}")
        if self.on_bad_policy not in BAD_POLICY_ACTIONS:
            raise ValueError(f"--layer-skip-on-bad-policy {self.on_bad_policy} is not one of "
                             f"{', '.join(BAD_POLICY_ACTIONS)}")


class SkipPlanner:
    """Decides each new request's SkipPlan (see module docstring)."""

    def __init__(self, model: nn.Module, config: LayerSkipConfig) -> None:
        config = self._resolve_auto(model, config)
        self.config = config
        self.mode = config.mode
        self.policy_state = PolicyState.NONE if config.policy_path is None else PolicyState.LOADED
        try:
            self.scheduler = Scheduler.from_model(model, config.policy_path, mode=config.mode)
        except ValueError as err:
            if config.on_bad_policy == "exit":
                raise
            logger.error(f"{err}. Serving with layer skipping OFF for every request "
                         f"(--layer-skip-on-bad-policy off)")
            self.policy_state = PolicyState.REFUSED
            self.mode = LayerSkipMode.OFF
            self.scheduler = Scheduler.from_model(model, None, mode=LayerSkipMode.OFF)
        # the runner executes the layers: the scheduler keeps only the embeddings its detector reads
        self.scheduler.detach_model()
        if config.policy_path is not None and self.policy_state == PolicyState.LOADED:
            logger.info(f"Layer-skip policy {config.policy_path} aligned to the loaded model; mode {self.mode}")
        policy = self.scheduler.policy
        # Graceful bypass: a skipped layer adds its mean residual update (from the sidecar).
        self.biases: dict[int, torch.Tensor] = dict(policy.biases) if policy.bypass == "graceful" else {}
        self.monitor: AuditMonitor | None = None
        if config.audit.rate > 0:
            calibration = self.scheduler.policy.calibration
            target = config.audit.target
            if target is None:
                target = calibration.consistency if calibration is not None else DEFAULT_CONSISTENCY_TARGET
            self.monitor = AuditMonitor(config.audit, target)

    @staticmethod
    def _resolve_auto(model: nn.Module, config: LayerSkipConfig) -> LayerSkipConfig:
        """`--layer-skip-policy auto` -> the matching shipped policy's path, or no policy and mode off."""
        if config.policy_path != AUTO:
            return config
        path = find_shipped_policy(model)
        if path is None:
            logger.warning(f"--layer-skip-policy auto: no policy in {policy_dir()} matches the served model's "
                           "fingerprints; serving with layer skipping off")
            return replace(config, policy_path=None, mode=LayerSkipMode.OFF)
        logger.info(f"--layer-skip-policy auto: {path} matches the served model")
        return replace(config, policy_path=str(path))

    def roll_back(self) -> None:
        """Stop skipping for every new request (the audit checks found the policy inconsistent)."""
        self.policy_state = PolicyState.ROLLED_BACK
        self.mode = LayerSkipMode.OFF

    @property
    def num_layers(self) -> int:
        return self.scheduler.num_layers

    def plan(self, state: RequestState) -> SkipPlan:
        """The request's plan; also records how long the decision took."""
        mode = state.layer_skip_mode or self.mode
        if mode == LayerSkipMode.OFF or self.policy_state in (PolicyState.REFUSED, PolicyState.ROLLED_BACK):
            return SkipPlan.off()
        start = time.perf_counter()
        plan = self.scheduler.plan(state.all_ids[: state.input_length], mode)
        state.decision_ms = (time.perf_counter() - start) * 1000
        return plan
