"""Shared fixtures: the real default model's checkpoint, and a real shard process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.pb import generate_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
SERVER_BIN = Path(sys.executable).parent / "text-generation-server"


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model as a local safetensors checkpoint (converted once, offline)."""
    return download_weights(DEFAULT_MODEL_ID)


class ShardProcess:
    """A real `text-generation-server serve` subprocess and a gRPC stub on its socket."""

    def __init__(self, model: str, extra_args: list[str], env: dict[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="tgi-shard-")
        self.uds_path = os.path.join(self.dir, "shard")
        self.log_path = os.path.join(self.dir, "shard.log")
        full_env = {**os.environ, "ATTENTION": "paged", "PREFIX_CACHING": "0", "OMP_NUM_THREADS": "2", **(env or {})}
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(SERVER_BIN), "serve", model, "--uds-path", self.uds_path, "--logger-level", "INFO", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
        )
        self.socket = f"{self.uds_path}-0"
        self.channel: grpc.Channel | None = None

    def wait_ready(self, timeout_s: float = 240) -> generate_pb2_grpc.TextGenerationServiceStub:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"shard exited with {self.proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard socket {self.socket} not ready:\n{self.logs()}")
            time.sleep(0.1)
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        return generate_pb2_grpc.TextGenerationServiceStub(self.channel)

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log_path).read_text()[-4000:]

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def shard(model_path: Path) -> Iterator[generate_pb2_grpc.TextGenerationServiceStub]:
    """A float32 shard of the default model, shared by the whole session."""
    process = ShardProcess(DEFAULT_MODEL_ID, [])
    try:
        yield process.wait_ready()
    finally:
        process.stop()
