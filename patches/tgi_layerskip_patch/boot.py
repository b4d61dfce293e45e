"""Runs at interpreter start (from tgi_layerskip_patch.pth): cheap, imports nothing heavy.

It installs an import hook only when TGI_LAYER_SKIP_MODE is set to something other than
"off"; otherwise upstream runs exactly as shipped. Configuration errors are raised later,
inside the shard's import of causal_lm, so that the shard refuses to start with the message
(an exception in a .pth line would only be printed and the shard would run unpatched).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "text_generation_server.models.causal_lm"
MODE_VARIABLE = "TGI_LAYER_SKIP_MODE"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds TARGET with the normal path finder, then patches the module right after it runs."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            from tgi_layerskip_patch.runtime import apply

            apply(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Install the import hook if layer skipping is requested (idempotent)."""
    if os.environ.get(MODE_VARIABLE, "off").strip().lower() in ("", "off"):
        return
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
