"""The shard's packages follow the request path: imports point one way and never in a cycle.

cli -> server (gRPC) -> engine -> speculative -> models -> layerskip; token choice (sampling)
below speculation; the top-level helpers (env, grammar, stopping, ...) are shared by all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from import_graph import cycle, graph

ROOT = Path(__file__).resolve().parents[2] / "server" / "text_generation_server"
STAGES = ("layerskip", "sampling", "models", "speculative", "engine", "layerskip_cli", "server", "cli", "pb")
ALLOWED = {
    "shared": {"layerskip"},
    "layerskip": set(),
    "sampling": {"shared"},
    "models": {"layerskip", "shared"},
    "speculative": {"models", "sampling", "layerskip", "shared"},
    "engine": {"speculative", "models", "sampling", "layerskip", "shared", "pb"},
    "layerskip_cli": {"speculative", "models", "sampling", "layerskip", "shared"},
    "server": {"engine", "sampling", "shared", "pb"},
    "cli": {"server", "engine", "speculative", "models", "layerskip_cli", "layerskip", "shared"},
}
GRAPH = graph(ROOT, "text_generation_server")


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else "shared"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down_the_request_path(module: str) -> None:
    stage = _stage(module)
    wrong = sorted(t for t in GRAPH[module] if _stage(t) != stage and _stage(t) not in ALLOWED[stage])
    assert not wrong, f"{module} ({stage}) may import only {sorted(ALLOWED[stage])}, imports {wrong}"


def test_no_import_cycle() -> None:
    found = cycle(GRAPH)
    assert found is None, "import cycle: " + " -> ".join(found or [])


@pytest.mark.parametrize("stage", ["engine", "speculative", "models", "sampling"])
def test_every_stage_is_a_package_that_says_what_it_does(stage: str) -> None:
    init = ROOT / stage / "__init__.py"
    assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{stage}/__init__.py needs a docstring"


def test_the_checker_sees_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
