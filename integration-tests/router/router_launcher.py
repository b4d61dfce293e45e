"""A real `text-generation-launcher` subprocess on a free port, for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from service_process import free_port, wait_healthy

STARTUP_TIMEOUT_S = 240
# Small limits keep warmup (one prefill of max_batch_prefill_tokens) short on 2 cores.
SMALL_LIMITS = ["--max-input-tokens", "256", "--max-total-tokens", "512",
                "--max-batch-prefill-tokens", "512"]


@dataclass
class Launcher:
    proc: subprocess.Popen[bytes]
    port: int
    uds_path: str
    log_path: Path
    prometheus_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def shard_socket(self) -> str:
        return f"{self.uds_path}-0"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return int(self.proc.returncode)


def start_launcher(extra: list[str], name: str, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                   env: dict[str, str] | None = None) -> Launcher:
    """Start the launcher (with `env` added to this process's environment) and wait until POST /
    answers (as upstream's tests do)."""
    port = free_port()
    uds = f"/tmp/tgi-router-tests-{name}-{os.getpid()}"
    log_path = Path(tempfile.mkstemp(prefix=f"launcher-{name}-", suffix=".log")[1])
    exe = str(Path(sys.executable).parent / "text-generation-launcher")
    prometheus_port = free_port()
    argv = [exe, "--port", str(port), "--shard-uds-path", uds, "--hostname", "127.0.0.1",
            "--prometheus-port", str(prometheus_port), *SMALL_LIMITS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    launcher = Launcher(proc, port, uds, log_path, prometheus_port)
    try:
        wait_healthy(proc, launcher.url, log_path, startup_timeout_s)
    except RuntimeError:
        launcher.stop()
        raise
    return launcher
