"""The shadow-check monitor of `lossy` in-process: its sampling, window and rollback rate
(integration-tests/server/test_audit_rollback.py drives the rollback in a real shard)."""

from __future__ import annotations

import pytest

from text_generation_server.engine.audit_check import AuditConfig, AuditMonitor


def test_monitor_window_and_rate() -> None:
    monitor = AuditMonitor(AuditConfig(rate=0.5, window=3), target=0.7)
    assert [monitor.should_audit() for _ in range(4)] == [False, True, False, True]
    assert not monitor.record(True) and not monitor.record(False)  # window not full yet
    assert monitor.record(False)  # 1/3 < 0.7
    assert monitor.rollbacks == 1
    with pytest.raises(ValueError, match="--layer-skip-shadow-rate 1.5 must be within"):
        AuditConfig(rate=1.5)
