"""Time to first token of a multi-turn chat and of requests sharing a document, with the shard's
prefix cache on and off, beside llama-server on the same GGUF.

Method: the servers run side by side on the loopback (ours with PREFIX_CACHING=1, ours with
PREFIX_CACHING=0, and with `--llama-server PATH` llama.cpp's `llama-server` on the model's own
GGUF file, 8 slots), OMP_NUM_THREADS=2 / `-t 2`, one request at a time:
- chat: a six-turn conversation through streamed `/v1/chat/completions` (greedy, 48 new tokens
  a turn) after a system prompt of about 1,000 tokens; each turn sends the whole history, as
  chat clients do. The servers take turns: turn k goes to each server before turn k + 1 goes to
  any. `--rounds` conversations, each with a system prompt of its own; per turn, the median
  over rounds. Time to first token = until the first chunk with content.
- rag: 8 requests, each a ~1,500-token document and its own question, sent at once, to one
  server after the other. Total prefill time = until the last of them has its first token
  (first token of each, too).
Each server continues its own conversation (its answers differ); the prompts are the same.

Usage: python benchmark/prefix_chat.py [--model ID] [--config bfloat16/verified]
       [--llama-server PATH] [--rounds 2] [--out prefix_chat]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

# memory.py puts integration-tests/ and integration-tests/router/ on sys.path (via disconnect_load).
from memory import CONTEXT, STARTUP_TIMEOUT_S, start_ours

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


async def chats(urls: dict[str, str], seed: int) -> dict[str, list[dict[str, Any]]]:
    """One conversation per server, turn by turn across the servers."""
    system = {"role": "system", "content": "You are the on-call assistant. The operations manual follows.\n"
              + manual(10, seed)}
    messages: dict[str, list[dict[str, str]]] = {name: [system] for name in urls}
    turns: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
    async with httpx.AsyncClient() as client:
        for k, question in enumerate(TURNS, start=1):
            for name, url in urls.items():
                messages[name].append({"role": "user", "content": question})
                turn = await stream_chat(client, url, messages[name])
                messages[name].append({"role": "assistant", "content": turn["answer"]})
                turns[name].append(turn)
                print(f"    turn {k} {name}: ttft {turn['ttft_s']:.2f} s, usage {turn['usage']}", flush=True)
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


@contextlib.contextmanager
def ours(model: str, config: str, caching: bool) -> Iterator[str]:
    os.environ["PREFIX_CACHING"] = "1" if caching else "0"
    launcher = start_ours(model, config, "prefix", [*LIMITS, "--max-concurrent-requests", "16"])
    try:
        yield launcher.url
    finally:
        launcher.stop()


@contextlib.contextmanager
def llama_server(binary: str, model: str, argv_out: list[str]) -> Iterator[str]:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    slots = len(QUESTIONS)
    argv = [binary, "-m", str(chunked_gguf(model)), "-c", str(CONTEXT * slots), "-np", str(slots), "-t", "2",
            "--host", "127.0.0.1", "--port", str(port)]
    argv_out.extend(argv)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log_path, STARTUP_TIMEOUT_S)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def summary(rows: dict[str, dict[str, Any]]) -> None:
    print("\ntime to first token (s), turns 1..6 (median over rounds); rag: all 8 first tokens (s)")
    for name, row in rows.items():
        turns = " ".join(f"{t:5.2f}" for t in row["ttft_s"])
        print(f"  {name:<24} {turns}   median 2-6 {statistics.median(row['ttft_s'][1:]):.2f}   "
              f"rag {row['rag']['prefill_s']:.2f}")
    on = rows["ours, cache on"]
    for other in ("ours, cache off", "llama-server"):
        if other in rows:
            ratios = [a / b for a, b in zip(on["ttft_s"][1:], rows[other]["ttft_s"][1:], strict=True)]
            print(f"  cache on / {other}: turns 2-6 {' '.join(f'{r:.2f}' for r in ratios)}; "
                  f"rag {on['rag']['prefill_s'] / rows[other]['rag']['prefill_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=QWEN_CODER_05B_ID)
    parser.add_argument("--config", default="bfloat16/verified", help="dtype/mode, as memory.py's --configs")
    parser.add_argument("--llama-server", default=None, help="path to a llama-server binary (peer row)")
    parser.add_argument("--rounds", type=int, default=2, help="conversations per server (medians per turn)")
    parser.add_argument("--out", default="prefix_chat")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    peer_argv: list[str] = []
    with contextlib.ExitStack() as servers:
        urls = {"ours, cache on": servers.enter_context(ours(args.model, args.config, True)),
                "ours, cache off": servers.enter_context(ours(args.model, args.config, False))}
        if args.llama_server:
            urls["llama-server"] = servers.enter_context(llama_server(args.llama_server, args.model, peer_argv))
        rounds = []
        for seed in range(args.rounds):
            print(f"  chat, round {seed + 1}", flush=True)
            rounds.append(asyncio.run(chats(urls, seed)))
        rows: dict[str, dict[str, Any]] = {}
        for name, url in urls.items():
            print(f"  rag, {name}", flush=True)
            chats_of = [[{k: v for k, v in t.items() if k != "times"} for t in r[name]] for r in rounds]
            rows[name] = {"chats": chats_of, "rag": asyncio.run(rag(url)),
                          "ttft_s": [statistics.median(c[k]["ttft_s"] for c in chats_of) for k in range(len(TURNS))]}
    if peer_argv:
        rows["llama-server"]["argv"] = peer_argv
    summary(rows)
    write_results(args.out, {"model": args.model, "config": args.config, "new_tokens": NEW_TOKENS,
                             "rounds": args.rounds, "turns": TURNS, "questions": QUESTIONS, "results": rows})

if __name__ == "__main__":
    sys.exit(main())
