"""The launcher shared by the request-isolation and fuzz tests (one start for both modules)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from isolation_harness import ISOLATION_LIMITS, NEIGHBOUR_TOKENS, greedy_ids
from router_launcher import Launcher, start_launcher


@pytest.fixture(scope="session")
def isolation_server() -> Iterator[Launcher]:
    launcher = start_launcher(ISOLATION_LIMITS, "isolation")
    yield launcher
    launcher.stop()  # already gone when the SIGKILL test ran


@pytest.fixture(scope="session")
def neighbour_solo(isolation_server: Launcher) -> list[int]:
    """The innocent neighbour's greedy tokens when it runs alone."""
    ids = greedy_ids(isolation_server.url, NEIGHBOUR_TOKENS)
    assert len(ids) == NEIGHBOUR_TOKENS
    return ids
