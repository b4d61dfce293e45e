"""A real `text-generation-server serve` subprocess for tests (its own module: several test
folders have a conftest.py, so importing from `conftest` is ambiguous)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from text_generation_server.pb import generate_pb2_grpc

SERVER_BIN = Path(sys.executable).parent / "text-generation-server"


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
