"""An HTTP server started as a subprocess (the launcher, the router): a free port to give it, and
the wait until its /health answers."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    """Return once GET {url}/health answers 200; RuntimeError with the log's tail when `proc` exits
    first or `timeout_s` passes."""
    name = Path(str(proc.args[0])).name
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} not healthy after {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")
