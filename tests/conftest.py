"""Shared fixtures: the real default model's checkpoint, and a real shard process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.pb import generate_pb2_grpc

from shard_process import ShardProcess


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model as a local safetensors checkpoint (converted once, offline)."""
    return download_weights(DEFAULT_MODEL_ID)


@pytest.fixture(scope="session")
def shard(model_path: Path) -> Iterator[generate_pb2_grpc.TextGenerationServiceStub]:
    """A float32 shard of the default model, shared by the whole session."""
    process = ShardProcess(DEFAULT_MODEL_ID, [])
    try:
        yield process.wait_ready()
    finally:
        process.stop()
