"""A package's import graph read from its source with ast (nothing is imported): for the
layering tests of the router and the shard."""

from __future__ import annotations

import ast
from pathlib import Path


def modules(root: Path, package: str, skip: tuple[str, ...] = ("pb",)) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `root` (the package's folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[0] in skip:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path], package: str,
            skip: tuple[str, ...] = ("pb",)) -> set[str]:
    """The package's modules that `name` imports, at module level or inside a function, except
    under `if TYPE_CHECKING:` (a skipped subpackage counts as one module)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            sub = next((s for s in skip if target == f"{package}.{s}" or target.startswith(f"{package}.{s}.")), None)
            if sub is not None:
                found.add(f"{package}.{sub}")
                continue
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                found.add(target)
    return found


def graph(root: Path, package: str) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imports(name, path, known, package) for name, path in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for target in sorted(edges.get(module, ())):
            found = visit(target, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(edges):
        found = visit(module, [])
        if found:
            return found
    return None
