"""The router's packages follow the request path: imports point one way and never in a cycle.

cli -> http -> engine -> pb; launcher apart; config, env and layer_skip (top level) are shared
by all and import nothing of the router. Read from the source with ast: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from import_graph import cycle, graph

ROOT = Path(__file__).resolve().parents[2] / "router" / "text_generation_router"
PKG = "text_generation_router"
ALLOWED = {
    "cli": {"http", "engine", "shared"},
    "http": {"engine", "shared"},
    "engine": {"pb", "shared"},
    "launcher": {"shared"},
    "shared": set(),
}


def _group(module: str) -> str:
    first = module.split(".")[1] if "." in module else ""
    if first in ("http", "engine", "launcher", "pb", "cli"):
        return first
    return "shared"  # the package itself (__version__), config, env, layer_skip


GRAPH = graph(ROOT, PKG)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down_the_request_path(module: str) -> None:
    group = _group(module)
    wrong = sorted(t for t in GRAPH[module] if _group(t) != group and _group(t) not in ALLOWED[group])
    assert not wrong, f"{module} ({group}) may import only {sorted(ALLOWED[group])}, imports {wrong}"


def test_no_import_cycle() -> None:
    found = cycle(GRAPH)
    assert found is None, "import cycle: " + " -> ".join(found or [])


def test_every_stage_is_a_package() -> None:
    for stage in ("http", "engine", "launcher"):
        init = ROOT / stage / "__init__.py"
        assert init.exists(), f"{stage}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{stage}/__init__.py needs a docstring"
