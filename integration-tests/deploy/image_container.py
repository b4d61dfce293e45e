"""The image `make image` builds (scripts/build_image.sh), run as `docker run` would run it, with
buildah (no Docker engine here): the image's user, entrypoint and command, then the arguments
given, inside a network namespace of our own that holds nothing but a loopback (offline).
Requests reach the server from inside that namespace (curl).

Needs root: buildah's image store and `ip netns`. build_image.sh installs buildah and mmdebstrap
with apt where they are missing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("IMAGE", "localhost/tgi-layerskip:latest")
BUILD_TIMEOUT_S = 1800
PORT = 8080


def run(*argv: str, timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)} exited with {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def build_image() -> str:
    """Build IMAGE (cached layers are reused when the sources did not change); its last line of output."""
    build = subprocess.run([str(ROOT / "scripts" / "build_image.sh")], env={**os.environ, "IMAGE": IMAGE},
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return build.stdout.strip().splitlines()[-1]


def image_config(kind: str = "OCIv1") -> dict[str, Any]:
    """IMAGE's configuration: `OCIv1` (entrypoint, command, user) or `Docker` (also the healthcheck)."""
    config: dict[str, Any] = json.loads(run("buildah", "inspect", "--type", "image", IMAGE))[kind]["config"]
    return config


class ImageServer:
    """The launcher the image's entrypoint starts, in a container and namespace of its own."""

    def __init__(self, data: Path, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.netns = f"tgi-image-{uuid.uuid4().hex[:8]}"
        run("ip", "netns", "add", self.netns)
        run("ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up")
        self.container = run("buildah", "from", "--quiet", IMAGE).strip()
        config = image_config()
        options = ["--volume", f"{data}:/data:ro", "--env", f"PORT={PORT}"]
        for key, value in (env or {}).items():
            options += ["--env", f"{key}={value}"]
        argv = [*self.run_argv(*options), *config["Entrypoint"], *(config.get("Cmd") or []), *args]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def run_argv(self, *options: str) -> list[str]:
        """The argv that runs a command (appended) in this container, inside its namespace."""
        return ["ip", "netns", "exec", self.netns, "buildah", "run", "--isolation", "chroot", *options,
                self.container, "--"]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.http("GET", "/health")[0] != 200:
            assert self.proc.poll() is None, f"the container exited with {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"not healthy after {timeout_s} s:\n{self.tail()}"
            time.sleep(1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def http(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        """One request from inside the namespace to the server on its loopback: (status, body)."""
        argv = ["ip", "netns", "exec", self.netns, "curl", "-sS", "-m", "300", "-X", method,
                "-o", "-", "-w", "\n%{http_code}", f"http://127.0.0.1:{PORT}{path}"]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=310)
        text, _, code = done.stdout.rpartition("\n")
        return int(code or 0), text

    def processes(self) -> list[tuple[int, int, str]]:
        """(pid, uid, command line) of every process in the container: those in the namespace but
        buildah's own (`buildah run` and its helpers run as root beside the container)."""
        rows = [(pid, run("ps", "-o", "uid=,args=", "-p", str(pid)).split(None, 1)) for pid in self.pids()]
        return [(pid, int(uid), args.strip()) for pid, (uid, args) in rows if not args.startswith("buildah")]

    def pids(self) -> list[int]:
        return [int(p) for p in run("ip", "netns", "pids", self.netns).split()]

    def stop(self) -> None:
        """As `docker stop`: SIGTERM to the entrypoint (the launcher drains, then stops its router and
        shard), SIGKILL to whatever is left after 90 s; then the container and namespace go."""
        launcher = [pid for pid, _, args in self.processes()
                    if any(word.endswith("text-generation-launcher") for word in args.split()[:2])]
        for sig, pids, wait_s in ((signal.SIGTERM, launcher, 90), (signal.SIGKILL, None, 30)):
            for pid in self.pids() if pids is None else pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.5)
            if not self.pids():
                break
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        subprocess.run(["buildah", "rm", self.container], capture_output=True, timeout=120)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=60)
