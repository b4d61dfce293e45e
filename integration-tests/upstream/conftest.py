"""Fixtures for the tests against upstream TGI's own shard (make test-upstream).

They need UPSTREAM_TGI (a checkout of huggingface/text-generation-inference) and the venv that
patches/setup_upstream_venv.sh built from it (UPSTREAM_VENV, default .venv-upstream); without
UPSTREAM_TGI every test here is skipped with the reason printed by `pytest -ra`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from upstream_shard import POLICY_LAYERS, ROOT, UpstreamShard, start_shard

SKIP_REASON = ("UPSTREAM_TGI is not set: run `make test-upstream UPSTREAM_TGI=<checkout of "
               "huggingface/text-generation-inference>` to test against upstream's shard")
UPSTREAM = os.environ.get("UPSTREAM_TGI")
UPSTREAM_VENV = Path(os.environ.get("UPSTREAM_VENV", str(ROOT / ".venv-upstream")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if UPSTREAM:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def upstream_python() -> Path:
    """The upstream venv's python; built from UPSTREAM_TGI when missing (make test-upstream
    always builds a fresh one first)."""
    python = UPSTREAM_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([str(ROOT / "patches" / "setup_upstream_venv.sh"), str(UPSTREAM), str(UPSTREAM_VENV)],
                       check=True, timeout=1800)
    return python


@pytest.fixture(scope="session")
def model_path() -> str:
    """The default model's local checkpoint (written to be readable by transformers 4.x)."""
    exe = Path(sys.executable).parent / "text-generation-server"
    out = subprocess.run([str(exe), "download-weights", "HuggingFaceTB/SmolLM2-135M-Instruct", "--json-output"],
                         capture_output=True, text=True, timeout=600, check=True)
    return str(json.loads(out.stdout.strip().splitlines()[-1])["local_path"])


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("upstream")


@pytest.fixture(scope="session")
def policy(upstream_python: Path, model_path: str, work_dir: Path) -> Path:
    path = work_dir / "policy.json"
    subprocess.run([str(upstream_python), str(Path(__file__).parent / "upstream_tool.py"), "policy", model_path,
                    str(path), *map(str, POLICY_LAYERS)], check=True, timeout=600)
    return path


@pytest.fixture(scope="module")
def unpatched_shard(upstream_python: Path, model_path: str, work_dir: Path) -> Iterator[UpstreamShard]:
    shard = start_shard(upstream_python, model_path, work_dir / "unpatched", {})
    yield shard
    shard.stop()
