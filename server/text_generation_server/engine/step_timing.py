"""Where one generation step's time goes: plan, forward, choose, stop, each measured apart.

The wire keeps upstream's two fields and their meaning: `forward_ns` is the forwards only,
`decode_ns` is token choice, detokenization and stop checks (`choose_ns + stop_ns`). Planning
(skip plans at prefill, draft cycles) has no field of its own; the servicer logs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum


class Stage(StrEnum):
    PLAN = "plan"  # skip plans of new requests, the draft cycle of each group
    FORWARD = "forward"  # model forwards (draft, verification, plain)
    CHOOSE = "choose"  # token choice (drafts included) and the groups' tensor updates
    STOP = "stop"  # detokenization, stop checks, drafting statistics, audit twins


@dataclass(frozen=True)
class StepTimings:
    plan_ns: int
    forward_ns: int
    choose_ns: int
    stop_ns: int

    @property
    def decode_ns(self) -> int:
        """The wire's decode time: everything after the forwards (upstream's meaning)."""
        return self.choose_ns + self.stop_ns


class StageClock:
    """Nanoseconds per stage of one step.

    Stages nest: entering one pauses the enclosing one, so the draft tokens chosen between the
    draft forwards count as choice, not as forward.
    """

    def __init__(self) -> None:
        self.ns = dict.fromkeys(Stage, 0)
        self._open: list[Stage] = []
        self._since = time.perf_counter_ns()

    @contextmanager
    def stage(self, stage: Stage) -> Iterator[None]:
        self._switch()
        self._open.append(stage)
        try:
            yield
        finally:
            self._switch()
            self._open.pop()

    def _switch(self) -> None:
        """Charge the time since the last switch to the innermost open stage."""
        now = time.perf_counter_ns()
        if self._open:
            self.ns[self._open[-1]] += now - self._since
        self._since = now

    def timings(self) -> StepTimings:
        ns = self.ns
        return StepTimings(ns[Stage.PLAN], ns[Stage.FORWARD], ns[Stage.CHOOSE], ns[Stage.STOP])
