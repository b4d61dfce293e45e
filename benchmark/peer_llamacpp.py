"""Our server against llama.cpp's `llama-server` end to end over HTTP, on the model's own GGUF.

Method: every server starts first and stays up (ours once per `--configs` entry, llama-server on
the GGUF that `download-weights` assembles for the model, and with `--lookup` llama-server again
with its n-gram speculation, `--spec-type ngram-simple`), each with 2 threads on the loopback. The
prompts are verified mode's four classes (`layerskip_cli/prompt_classes.py`): code completion
through `/v1/completions`, code editing, chat and summarisation through `/v1/chat/completions`;
greedy, `--new-tokens` new tokens, streamed. Servers alternate prompt by prompt (the order
rotates), so a drift of the machine's speed falls on all of them:
- one client: each of `--per-class` prompts of a class sent alone to each server in turn;
- 4 concurrent clients: 4 other prompts of the class (none sent before: a prompt already sent
  would be answered from both servers' prefix caches) at once to one server, then to the next.
Per request: time to first token (first streamed text) and tokens/s (completion tokens over the
request's whole time). Reported per class and client count: medians over prompts, and each
server's tokens/s over llama-server's (the first peer row).

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/peer_llamacpp.py --llama-server PATH
       [--model ID] [--configs nf4/verified,bfloat16/verified] [--per-class 4] [--new-tokens 128]
       [--lookup] [--out peer_llamacpp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

# memory.py puts integration-tests/ and integration-tests/router/ on sys.path (via disconnect_load).
from memory import STARTUP_TIMEOUT_S, launcher_env, launcher_flags, start_ours
from prefix_chat import LIMITS

from text_generation_server.download import QWEN_CODER_05B_ID, chunked_gguf
from text_generation_server.layerskip_cli.prompt_classes import CLASSES, build

from common import sse_events, write_results
from service_process import free_port, wait_healthy

CLIENTS = 4
PEER = "llama-server"


def llama_server(stack: ExitStack, binary: str, model: str, extra: list[str]) -> tuple[str, list[str]]:
    """Start llama-server with CLIENTS slots of 4,096 tokens each; its URL and argv."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    argv = [binary, "-m", str(chunked_gguf(model)), "-c", str(4096 * CLIENTS), "-np", str(CLIENTS), "-t", "2",
            "--host", "127.0.0.1", "--port", str(port), *extra]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(lambda: (proc.terminate(), proc.wait(timeout=60)))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log_path, STARTUP_TIMEOUT_S)
    return url, argv


async def request(client: httpx.AsyncClient, url: str, row: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """One streamed greedy request: time to first text, total time, completion tokens."""
    body: dict[str, Any] = {"model": "tgi", "max_tokens": new_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if "prompt" in row:
        route, body["prompt"] = "/v1/completions", row["prompt"]
    else:
        route, body["messages"] = "/v1/chat/completions", row["messages"]
    start, first, chunks, usage = time.perf_counter(), None, 0, None
    async with client.stream("POST", url + route, json=body, timeout=1800) as response:
        response.raise_for_status()
        async for chunk in sse_events(response.aiter_lines()):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    chunks += 1
                    first = first or time.perf_counter()
    total = time.perf_counter() - start
    tokens = int(usage["completion_tokens"]) if usage else chunks
    assert first is not None, f"{row['id']}: no text streamed"
    return {"id": row["id"], "ttft_s": first - start, "total_s": total, "tokens": tokens, "tok_s": tokens / total}


async def run(servers: dict[str, str], rows: list[dict[str, Any]], new_tokens: int) -> dict[str, Any]:
    names = list(servers)
    results: dict[str, dict[str, Any]] = {name: {c: {"1": [], str(CLIENTS): []} for c in CLASSES} for name in names}
    async with httpx.AsyncClient() as client:
        for turn, row in enumerate(r for r in rows if r["round"] == 1):  # one client
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                answer = await request(client, servers[name], row, new_tokens)
                results[name][row["category"]]["1"].append(answer)
            print(f"  1 client  {row['id']}: " + ", ".join(
                f"{n} {results[n][row['category']]['1'][-1]['tok_s']:.1f} tok/s" for n in names), flush=True)
        for turn, category in enumerate(CLASSES):  # concurrent clients, a class's first prompts at once
            group = [r for r in rows if r["category"] == category and r["round"] == CLIENTS]
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                start = time.perf_counter()
                answers = await asyncio.gather(*(request(client, servers[name], r, new_tokens) for r in group))
                wall = time.perf_counter() - start
                results[name][category][str(CLIENTS)] = {"requests": answers, "wall_s": wall,
                                                         "tok_s": sum(a["tokens"] for a in answers) / wall}
            print(f"  {CLIENTS} clients {category}: " + ", ".join(
                f"{n} {results[n][category][str(CLIENTS)]['tok_s']:.1f} tok/s" for n in names), flush=True)
    return results


def table(results: dict[str, Any]) -> dict[str, Any]:
    """Medians per server, class and client count, and tokens/s over llama-server's."""
    out: dict[str, Any] = {}
    for name, classes in results.items():
        for category, runs in classes.items():
            one, many = runs["1"], runs[str(CLIENTS)]
            out.setdefault(name, {})[category] = {
                "1": {"tok_s": statistics.median(a["tok_s"] for a in one),
                      "ttft_s": statistics.median(a["ttft_s"] for a in one)},
                str(CLIENTS): {"tok_s": many["tok_s"],
                               "ttft_s": statistics.median(a["ttft_s"] for a in many["requests"])}}
    for classes in out.values():
        for category, by_clients in classes.items():
            for clients, cell in by_clients.items():
                cell["vs_peer"] = cell["tok_s"] / out[PEER][category][clients]["tok_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="path to a llama-server binary")
    parser.add_argument("--model", default=QWEN_CODER_05B_ID)
    parser.add_argument("--configs", default="nf4/verified,bfloat16/verified", help="dtype/mode, as memory.py's")
    parser.add_argument("--per-class", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--lookup", action="store_true", help="also llama-server with --spec-type ngram-simple")
    parser.add_argument("--out", default="peer_llamacpp")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows, seen = build(args.per_class + CLIENTS), dict.fromkeys(CLASSES, 0)
    for row in rows:  # each class's first prompts for one client, the next ones for the concurrent round
        row["round"] = 1 if seen[row["category"]] < args.per_class else CLIENTS
        seen[row["category"]] += 1
    servers: dict[str, str] = {}
    argvs: dict[str, list[str]] = {}
    with ExitStack() as stack:
        servers[PEER], argvs[PEER] = llama_server(stack, args.llama_server, args.model, [])
        if args.lookup:
            name = f"{PEER} + ngram"
            servers[name], argvs[name] = llama_server(stack, args.llama_server, args.model,
                                                      ["--spec-type", "ngram-simple"])
        for config in args.configs.split(","):
            extra = [*LIMITS, "--max-concurrent-requests", "16"]
            launcher = start_ours(args.model, config, "peer", extra)
            stack.callback(launcher.stop)
            env = [f"{name}={value}" for name, value in launcher_env(config).items()]
            servers[f"ours {config}"] = launcher.url
            argvs[f"ours {config}"] = [*env, *launcher_flags(args.model, config), *extra]
        print(f"servers up: {', '.join(servers)}", flush=True)
        results = asyncio.run(run(servers, rows, args.new_tokens))
    medians = table(results)
    print(f"\ntokens/s (x {PEER}) / time to first token s, medians; {args.model}, {args.new_tokens} new tokens")
    for name, classes in medians.items():
        cells = [f"{c} {by[k]['tok_s']:.1f} ({by[k]['vs_peer']:.2f}x) / {by[k]['ttft_s']:.2f}"
                 for c, by in classes.items() for k in ("1", str(CLIENTS))]
        print(f"  {name:<28} " + " | ".join(cells))
    write_results(args.out, {"model": args.model, "new_tokens": args.new_tokens, "per_class": args.per_class,
                             "clients": [1, CLIENTS], "argv": argvs, "medians": medians, "requests": results})


if __name__ == "__main__":
    sys.exit(main())
