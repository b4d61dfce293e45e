"""Online audit checks of `lossy`: measured consistency in production, automatic rollback.

(Not the `shadow` mode, which decides and reports a plan but bypasses nothing. The CLI flags
and the reported statistics keep their upstream-facing names: --layer-skip-shadow-rate,
--layer-skip-shadow-window, `shadow_consistency`, `shadow_checks`.)

Design note: a fraction of greedy lossy requests (every n-th, deterministic) gets a hidden
twin: the same prompt and parameters in mode `off`, added to the same batch. Twins run in
lockstep with their primary (one token per step each) and are never reported to the router.
When the primary finishes (or the two diverge) the token ids are compared, and the result
enters a sliding window. When the window's exact-match ratio falls below the target, the
planner rolls back to `off` for every new request, logs it and counts it; requests already
running keep their plans (their KV caches were built for them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from loguru import logger

from ..layerskip import LayerSkipMode, SkipPlan
from ..sampling import NextTokenChooser
from .batch import CausalLMBatch, RequestState

AUDIT_ID_BASE = 1 << 63  # twin request ids: never produced by a router (ids count up from 0)


@dataclass(frozen=True)
class AuditConfig:
    """Attributes:
    rate: fraction of greedy lossy requests that get an `off` twin (0 disables the checks).
    window: how many recent comparisons the consistency ratio covers.
    target: roll back when the ratio over a full window falls below this; None takes the
        policy's calibrated consistency.
    """

    rate: float = 0.0
    window: int = 20
    target: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"--layer-skip-shadow-rate {self.rate} must be within [0, 1]")
        if self.window < 1:
            raise ValueError(f"--layer-skip-shadow-window {self.window} must be at least 1")
        if self.target is not None and not 0.0 <= self.target <= 1.0:
            raise ValueError(f"--layer-skip-consistency-target {self.target} must be within [0, 1]")


class AuditMonitor:
    """Chooses which requests get an audit twin and keeps the consistency window."""

    def __init__(self, config: AuditConfig, target: float) -> None:
        self.config = config
        self.target = target
        self.results: deque[bool] = deque(maxlen=config.window)
        self.seen = 0
        self.rollbacks = 0

    def should_audit(self) -> bool:
        """Every round(1 / rate)-th eligible request (deterministic, so tests and operators can reason)."""
        if self.config.rate <= 0:
            return False
        self.seen += 1
        return self.seen % max(1, round(1 / self.config.rate)) == 0

    @property
    def consistency(self) -> float:
        return sum(self.results) / len(self.results) if self.results else 1.0

    def record(self, consistent: bool) -> bool:
        """Add one comparison; True when it triggers a rollback."""
        self.results.append(consistent)
        if len(self.results) < self.config.window or self.consistency >= self.target:
            return False
        self.rollbacks += 1
        logger.error(f"Layer-skip rollback: shadow consistency {self.consistency:.3f} over the last "
                     f"{len(self.results)} checked lossy requests is below the target {self.target:.3f}; "
                     f"serving every new request with layer skipping off")
        return True


def add_twins(batch: CausalLMBatch, monitor: AuditMonitor) -> None:
    """Before grouping: give the chosen greedy lossy requests an `off` twin in the same batch."""
    for state in list(batch.requests):
        plan = state.plan
        constrained = state.chooser.grammar is not None or state.chooser.watermark is not None
        lossy = plan is not None and plan.mode == LayerSkipMode.LOSSY and bool(plan.applied)
        if not lossy or state.chooser.params.sampling or constrained:
            continue
        if not monitor.should_audit():
            continue
        twin = RequestState(
            id=AUDIT_ID_BASE + state.id, all_ids=list(state.all_ids), input_length=state.input_length,
            chooser=NextTokenChooser(state.chooser.params),
            stopping=replace(state.stopping, num_generated=0, tail=""),
            plan=SkipPlan.off(), audit_of=state.id,
            prefix_offset=state.prefix_offset, read_offset=state.read_offset,
        )
        batch.requests.append(twin)


def compare_twins(batch: CausalLMBatch, monitor: AuditMonitor) -> bool:
    """After a step: settle the twins whose outcome is known; True when that triggers a rollback."""
    by_id = {s.id: s for s in batch.requests}
    settled: list[int] = []
    rollback = False
    for twin in [s for s in batch.requests if s.audit_of is not None]:
        primary = by_id.get(twin.audit_of)  # type: ignore[arg-type]
        if primary is None:  # the router filtered the primary away (cancelled): no verdict
            settled.append(twin.id)
            continue
        diverged = primary.generated_ids != twin.generated_ids
        if diverged or primary.finished or twin.finished:
            rollback |= monitor.record(not diverged and primary.finished == twin.finished)
            settled.append(twin.id)
    if settled:
        batch.drop(settled)
    return rollback
