"""Router overhead: per-token latency through HTTP vs straight to the shard over gRPC, and
aggregate decode throughput at 1, 4 and 16 concurrent HTTP streams.

Method: one `text-generation-launcher` on the default model (OMP_NUM_THREADS=2). Latency
runs alternate A (HTTP /generate_stream) and B (gRPC Prefill/Decode on the launcher's own
shard socket) five times each with the same greedy prompt and max_new_tokens; the per-token
figure is the time from the first to the last token divided by the tokens in between, and
the table reports medians. Throughput counts generated tokens over wall time for N parallel
streams. Writes benchmark/results/router_overhead.json.

Usage: .venv/bin/python benchmark/router_overhead.py [--new-tokens 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx

from text_generation_router.pb import generate_pb2 as pb
from text_generation_router.pb import generate_pb2_grpc as pb_grpc

PROMPT = "def fibonacci(n):"
PROMPTS = [PROMPT, "The three primary colors are", "import numpy as np\n", "Once upon a time,"]
RESULTS = Path(__file__).parent / "results" / "router_overhead.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_launcher(port: int, uds: str) -> subprocess.Popen[bytes]:
    exe = str(Path(sys.executable).parent / "text-generation-launcher")
    argv = [exe, "--port", str(port), "--hostname", "127.0.0.1", "--shard-uds-path", uds,
            "--max-input-tokens", "256", "--max-total-tokens", "512",
            "--max-batch-prefill-tokens", "512"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("launcher exited during startup")
        time.sleep(1)
    raise RuntimeError("launcher did not become ready")


def http_stream(url: str, prompt: str, new_tokens: int) -> list[float]:
    """Arrival time of each streamed token."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}}
    stamps = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                stamps.append(time.perf_counter())
    return stamps


def grpc_stream(stub: pb_grpc.TextGenerationServiceStub, batch_id: int, prompt: str,
                new_tokens: int) -> list[float]:
    request = pb.Request(
        id=batch_id, inputs=prompt, truncate=256, add_special_tokens=True,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=prompt)]),
        parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                 repetition_penalty=1.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=new_tokens),
    )
    answer = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=[request], size=1)))
    stamps = [time.perf_counter()]
    while not answer.generations[0].HasField("generated_text"):
        answer = stub.Decode(pb.DecodeRequest(batches=[answer.batch]))
        stamps.append(time.perf_counter())
    if answer.HasField("batch"):
        stub.ClearCache(pb.ClearCacheRequest(id=answer.batch.id))
    return stamps


def per_token_s(stamps: list[float]) -> float:
    return (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)


def latency(url: str, uds: str, new_tokens: int, repeats: int) -> dict[str, float]:
    http_runs, grpc_runs = [], []
    with grpc.insecure_channel(f"unix://{uds}-0") as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        http_stream(url, PROMPT, 4)  # warm both paths once
        grpc_stream(stub, 1 << 40, PROMPT, 4)
        for n in range(repeats):
            http_runs.append(per_token_s(http_stream(url, PROMPT, new_tokens)))
            grpc_runs.append(per_token_s(grpc_stream(stub, (1 << 40) + n + 1, PROMPT, new_tokens)))
    http_ms = statistics.median(http_runs) * 1000
    grpc_ms = statistics.median(grpc_runs) * 1000
    return {"http_ms_per_token": http_ms, "grpc_ms_per_token": grpc_ms,
            "overhead_ratio": http_ms / grpc_ms}


def throughput(url: str, streams: int, new_tokens: int) -> dict[str, float]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: http_stream(url, p, new_tokens), prompts))
    elapsed = time.perf_counter() - started
    tokens = sum(len(r) for r in results)
    return {"streams": streams, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    port, uds = free_port(), f"/tmp/tgi-bench-router-{os.getpid()}"
    proc = start_launcher(port, uds)
    url = f"http://127.0.0.1:{port}"
    try:
        lat = latency(url, uds, args.new_tokens, args.repeats)
        rates = [throughput(url, n, args.new_tokens) for n in (1, 4, 16)]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    result = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "threads": 2,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "latency": lat,
              "throughput": rates,
              "speedup_16_vs_1": rates[2]["tokens_per_s"] / rates[0]["tokens_per_s"]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"per-token latency (median of {args.repeats}, A B interleaved, {args.new_tokens} tokens)")
    print(f"  HTTP /generate_stream : {lat['http_ms_per_token']:8.2f} ms")
    print(f"  gRPC straight to shard: {lat['grpc_ms_per_token']:8.2f} ms")
    print(f"  ratio HTTP/gRPC       : {lat['overhead_ratio']:8.3f}")
    print("aggregate decode throughput through HTTP")
    print(f"  {'streams':>7} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    for r in rates:
        print(f"  {r['streams']:>7} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.1f}")
    print(f"  16 streams vs 1: {result['speedup_16_vs_1']:.2f}x")


if __name__ == "__main__":
    main()
