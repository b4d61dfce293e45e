"""Launchers shared across modules: `isolation_server` (request-isolation and fuzz tests) and
`server` (the HTTP, guided-generation and conformance tests), each started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from isolation_harness import ISOLATION_LIMITS, NEIGHBOUR_TOKENS, greedy_ids
from router_launcher import Launcher, start_launcher


@pytest.fixture(scope="session")
def isolation_server() -> Iterator[Launcher]:
    launcher = start_launcher(ISOLATION_LIMITS, "isolation")
    yield launcher
    assert launcher.stop() == 0, launcher.log()[-3000:]


@pytest.fixture(scope="session")
def neighbour_solo(isolation_server: Launcher) -> list[int]:
    """The innocent neighbour's greedy tokens when it runs alone."""
    ids = greedy_ids(isolation_server.url, NEIGHBOUR_TOKENS)
    assert len(ids) == NEIGHBOUR_TOKENS
    return ids


@pytest.fixture(scope="session")
def server() -> Iterator[Launcher]:
    """The default model behind a launcher with the small limits; also watermark flags, to check
    that the launcher passes them to the shard."""
    launcher = start_launcher(["--watermark-gamma", "0.5", "--watermark-delta", "2.0"], "http")
    yield launcher
    assert launcher.stop() == 0, launcher.log()[-3000:]
