"""Shared fixtures of the end-to-end tests: the real default model's checkpoint, and a real shard
process serving it over its unix socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from text_generation_server.download import DEFAULT_MODEL_ID
from text_generation_server.pb import generate_pb2_grpc

from model_fixtures import model_path  # noqa: F401 - the session fixture `shard` waits on
from shard_process import ShardProcess


@pytest.fixture(scope="session")
def shard(model_path: Path) -> Iterator[generate_pb2_grpc.TextGenerationServiceStub]:  # noqa: F811
    """A float32 shard of the default model, shared by the whole session."""
    process = ShardProcess(DEFAULT_MODEL_ID, [])
    try:
        yield process.wait_ready()
    finally:
        process.stop()
