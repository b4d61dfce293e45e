"""The fixture both trees share: the real default model's checkpoint (tests/conftest.py and
integration-tests/conftest.py import it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model as a local safetensors checkpoint (converted once, offline)."""
    return download_weights(DEFAULT_MODEL_ID)
