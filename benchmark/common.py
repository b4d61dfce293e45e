"""Helpers shared by the benchmarks: interleaved timing, medians, JSON output, a shard process."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style server-sent stream (`data:` lines; `[DONE]` left out)."""
    async for line in lines:
        if line.startswith("data:") and line.strip() != "data: [DONE]":
            yield json.loads(line[5:])


def interleave(runs: dict[str, Callable[[], float]], repeats: int = 5) -> dict[str, list[float]]:
    """Run each measurement in turn (A B A B ...) `repeats` times; each returns a figure."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats):
        for name, run in runs.items():
            figures[name].append(run())
            print(f"  repeat {i + 1}/{repeats} {name}: {figures[name][-1]:.2f}", flush=True)
    return figures


def summarize(figures: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    return {name: {"median": statistics.median(v), "runs": v} for name, v in figures.items()}


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write benchmark/results/NAME.json, or NAME itself when it is a path ending in .json."""
    path = Path(name) if name.endswith(".json") else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}, **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def start_shard(model_id: str, extra: list[str], threads: int) -> tuple[subprocess.Popen[bytes], str]:
    """Start `text-generation-server serve` and wait for its socket; returns (process, socket)."""
    base = os.path.join(tempfile.mkdtemp(prefix="tgi-bench-"), "shard")
    env = {**os.environ, "ATTENTION": "paged", "PREFIX_CACHING": "0", "OMP_NUM_THREADS": str(threads)}
    binary = Path(sys.executable).parent / "text-generation-server"
    proc = subprocess.Popen([str(binary), "serve", model_id, "--uds-path", base, *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socket = f"{base}-0"
    while not os.path.exists(socket):
        if proc.poll() is not None:
            raise RuntimeError(f"shard exited with {proc.returncode}")
        time.sleep(0.2)
    return proc, socket
