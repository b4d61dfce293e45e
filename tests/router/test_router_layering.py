"""The router's packages follow the request path: imports point one way and never in a cycle.

cli -> http -> engine -> pb; launcher apart; config, env and layer_skip (top level) are shared
by all and import nothing of the router. Read from the source with ast: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "router" / "text_generation_router"
PKG = "text_generation_router"
ALLOWED = {
    "cli": {"http", "engine", "shared"},
    "http": {"engine", "shared"},
    "engine": {"pb", "shared"},
    "launcher": {"shared"},
    "shared": set(),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "pb":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PKG, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The router's modules that `name` imports (at module level or not; pb as one module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == f"{PKG}.pb" or target.startswith(f"{PKG}.pb."):
                found.add(f"{PKG}.pb")
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _group(module: str) -> str:
    first = module.split(".")[1] if "." in module else ""
    if first in ("http", "engine", "launcher", "pb", "cli"):
        return first
    return "shared"  # the package itself (__version__), config, env, layer_skip


MODULES = _modules()
GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_request_path(module: str) -> None:
    group = _group(module)
    wrong = sorted(t for t in GRAPH[module] if _group(t) != group and _group(t) not in ALLOWED[group])
    assert not wrong, f"{module} ({group}) may import only {sorted(ALLOWED[group])}, imports {wrong}"


def test_no_module_imports_itself_back() -> None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for target in sorted(GRAPH.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(GRAPH):
        visit(module, [])


def test_every_stage_is_a_package() -> None:
    for stage in ("http", "engine", "launcher"):
        init = ROOT / stage / "__init__.py"
        assert init.exists(), f"{stage}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{stage}/__init__.py needs a docstring"
