"""Time to first token of a multi-turn chat and of requests sharing a document, with the shard's
prefix cache on and off, beside llama-server on the same GGUF.

Method: each server in turn (ours with PREFIX_CACHING=1, ours with PREFIX_CACHING=0, and with
`--llama-server PATH` llama.cpp's `llama-server` on the model's own GGUF file, 8 slots), one
at a time on the loopback, OMP_NUM_THREADS=2 / `-t 2`:
- chat: a six-turn conversation through streamed `/v1/chat/completions` (greedy, 48 new tokens
  a turn) after a system prompt of about 1,000 tokens; each turn sends the whole history, as
  chat clients do. Time to first token = until the first chunk with content.
- rag: 8 requests, each a ~1,500-token document and its own question, sent at once. Total
  prefill time = until the last of them has its first token (first token of each, too).
Each server continues its own conversation (its answers differ); the prompts are the same.

Usage: python benchmark/prefix_chat.py [--model ID] [--config bfloat16/verified]
       [--llama-server PATH] [--out prefix_chat]
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
from pathlib import Path
from typing import Any

import httpx

# memory.py puts integration-tests/ and integration-tests/router/ on sys.path (via disconnect_load).
from memory import CONTEXT, STARTUP_TIMEOUT_S, launcher_flags
from router_launcher import start_launcher

from text_generation_server.download import QWEN_CODER_05B_ID, chunked_gguf

from common import sse_events, write_results
from service_process import free_port, wait_healthy

TURNS = ["What does the monitoring section ask an operator to check first?",
         "Summarise the backup policy in two sentences.",
         "Which services restart automatically, and which need a person?",
         "Write a shell one-liner that finds the largest log file.",
         "What should happen when a disk passes 90 percent?",
         "List the three most important rules of this manual."]
QUESTIONS = ["Who owns the billing service?", "How often are backups tested?", "What is the paging policy?",
             "Which port does the cache listen on?", "How are secrets rotated?", "What is the deploy window?",
             "How long are logs kept?", "Who approves a schema change?"]
NEW_TOKENS = 48
# 4,096-token limits (argparse keeps the last value): the router's warm-up prefills
# --max-batch-prefill-tokens at once, with prompt logprobs, which takes minutes at 8,192 on AVX2 CPUs.
LIMITS = ["--max-input-tokens", "4000", "--max-total-tokens", "4096", "--max-batch-prefill-tokens", "4096"]
COMPONENTS = ["billing", "search", "cache", "gateway", "scheduler", "mailer", "indexer", "auth", "reports", "storage"]


def manual(sections: int, seed: int) -> str:
    """A made-up operations manual (deterministic), about 95 tokens a section."""
    lines = []
    for i in range(sections):
        c = COMPONENTS[(i * 7 + seed) % len(COMPONENTS)]
        n = (i * 37 + seed * 11) % 90 + 10
        lines.append(
            f"Section {i + 1}: the {c} service. It runs {n % 7 + 2} replicas behind the gateway and listens on port "
            f"{8000 + n}. Its owner is team {COMPONENTS[(i + seed) % len(COMPONENTS)]}. Backups of its data are taken "
            f"every {n % 12 + 1} hours and tested every {n % 5 + 1} weeks. When its error rate passes {n / 10:.1f} "
            f"percent for five minutes, the on-call engineer is paged; a restart is automatic only when the health "
            f"check fails {n % 4 + 2} times in a row. Logs are kept for {n} days.")
    return "\n".join(lines)


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
                      max_tokens: int = NEW_TOKENS, started: tuple[int, asyncio.Event] | None = None) -> dict[str, Any]:
    """One streamed chat completion, greedy: time to first content token, total time, the answer,
    the arrival time (perf_counter) of every chunk with content after the send time (`times[0]`).
    `started` (n, event): the event is set once n chunks with content have arrived."""
    body = {"model": "tgi", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    times = [time.perf_counter()]
    text, usage = [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        async for chunk in sse_events(response.aiter_lines()):
            usage = chunk.get("usage") or usage
            contents = [(c.get("delta") or {}).get("content") for c in chunk.get("choices", [])]
            if any(contents):
                times.append(time.perf_counter())
                text += [c for c in contents if c]
                if started is not None and len(times) > started[0]:
                    started[1].set()
    end = time.perf_counter()
    assert len(times) > 1, "no content streamed"
    return {"ttft_s": times[1] - times[0], "total_s": end - times[0], "answer": "".join(text), "usage": usage,
            "times": times}


async def chat(url: str) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "You are the on-call assistant. The operations manual follows.\n"
                 + manual(10, 0)}]
    turns = []
    async with httpx.AsyncClient() as client:
        for question in TURNS:
            messages.append({"role": "user", "content": question})
            turn = await stream_chat(client, url, messages)
            messages.append({"role": "assistant", "content": turn["answer"]})
            turns.append(turn)
            print(f"    turn {len(turns)}: ttft {turn['ttft_s']:.2f} s, usage {turn['usage']}", flush=True)
    return turns


async def rag(url: str) -> dict[str, Any]:
    document = manual(16, 3)
    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(stream_chat(client, url, [
            {"role": "system", "content": "Answer from the document.\n" + document},
            {"role": "user", "content": q}]) for q in QUESTIONS))
    ttfts = [a["ttft_s"] for a in answers]
    prefill = max(ttfts)
    print(f"    rag: all first tokens after {prefill:.2f} s (first {min(ttfts):.2f} s)", flush=True)
    return {"prefill_s": prefill, "ttft_s": ttfts, "elapsed_s": time.perf_counter() - start,
            "usage": [a["usage"] for a in answers]}


def ours(model: str, config: str, caching: bool) -> dict[str, Any]:
    os.environ["PREFIX_CACHING"] = "1" if caching else "0"
    launcher = start_launcher([*launcher_flags(model, config), *LIMITS, "--max-concurrent-requests", "16"], "prefix")
    try:
        print(f"  ours {config} PREFIX_CACHING={int(caching)}", flush=True)
        return {"chat": asyncio.run(chat(launcher.url)), "rag": asyncio.run(rag(launcher.url))}
    finally:
        launcher.stop()


def llama_server(binary: str, model: str) -> dict[str, Any]:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    slots = len(QUESTIONS)
    argv = [binary, "-m", str(chunked_gguf(model)), "-c", str(CONTEXT * slots), "-np", str(slots), "-t", "2",
            "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log_path, STARTUP_TIMEOUT_S)
        print(f"  llama-server ({' '.join(argv[1:])})", flush=True)
        return {"argv": argv, "chat": asyncio.run(chat(url)), "rag": asyncio.run(rag(url))}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def summary(rows: dict[str, dict[str, Any]]) -> None:
    print("\ntime to first token (s), turns 1..6; rag: all 8 first tokens (s)")
    for name, row in rows.items():
        turns = " ".join(f"{t['ttft_s']:5.2f}" for t in row["chat"])
        later = statistics.median(t["ttft_s"] for t in row["chat"][1:])
        print(f"  {name:<24} {turns}   median 2-6 {later:.2f}   rag {row['rag']['prefill_s']:.2f}")
    on, off = rows.get("ours, cache on"), rows.get("ours, cache off")
    if on and off:
        ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(on["chat"][1:], off["chat"][1:], strict=True)]
        print(f"  cache on / off: turns 2-6 {' '.join(f'{r:.2f}' for r in ratios)}; "
              f"rag {on['rag']['prefill_s'] / off['rag']['prefill_s']:.2f}")
    peer = rows.get("llama-server")
    if on and peer:
        ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(on["chat"][1:], peer["chat"][1:], strict=True)]
        print(f"  cache on / llama-server: turns 2-6 {' '.join(f'{r:.2f}' for r in ratios)}; "
              f"rag {on['rag']['prefill_s'] / peer['rag']['prefill_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=QWEN_CODER_05B_ID)
    parser.add_argument("--config", default="bfloat16/verified", help="dtype/mode, as memory.py's --configs")
    parser.add_argument("--llama-server", default=None, help="path to a llama-server binary (peer row)")
    parser.add_argument("--out", default="prefix_chat")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows: dict[str, dict[str, Any]] = {}
    if args.llama_server:
        rows["llama-server"] = llama_server(args.llama_server, args.model)
    rows["ours, cache on"] = ours(args.model, args.config, True)
    rows["ours, cache off"] = ours(args.model, args.config, False)
    summary(rows)
    write_results(args.out, {"model": args.model, "config": args.config, "new_tokens": NEW_TOKENS,
                             "turns": TURNS, "questions": QUESTIONS, "results": rows})


if __name__ == "__main__":
    sys.exit(main())
