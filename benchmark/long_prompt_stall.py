"""How long a running stream stalls while a long prompt is prefilled, with chunked prefill on and off.

Method: for each PREFILL_CHUNK_TOKENS value (the shard's default 512, then 0 = a prefill runs at
once), one launcher (loopback, OMP_NUM_THREADS=2): stream A (a chat completion, greedy, 256 new
tokens) starts; once it has streamed 16 chunks, request B arrives: a ~3,000-token prompt,
streamed, 8 new tokens. Reported: B's time to first token, and A's longest gap between two
streamed chunks while B was prefilling (and over A's whole stream). The target: A's longest
gap at most 0.25x B's time to first token.

Usage: python benchmark/long_prompt_stall.py [--model ID] [--config bfloat16/verified]
       [--chunks 512,0] [--out long_prompt_stall]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import httpx

# memory.py puts integration-tests/ and integration-tests/router/ on sys.path (via disconnect_load).
from memory import start_ours
from prefix_chat import LIMITS, manual, stream_chat

from text_generation_server.download import QWEN_CODER_05B_ID

from common import write_results

STREAM = [{"role": "user", "content": "Write a Python module with a class for a bank account, with deposit, "
           "withdraw, transfer and a history of transactions, each method documented."}]
STREAM_TOKENS = 256
STARTED_AFTER = 16  # A's streamed chunks before B is sent


async def measure(url: str) -> dict[str, Any]:
    long_prompt = [{"role": "system", "content": "Answer from the manual.\n" + manual(31, 5)},
                   {"role": "user", "content": "Which service listens on port 8042?"}]
    started = asyncio.Event()
    async with httpx.AsyncClient() as client:
        a = asyncio.create_task(stream_chat(client, url, STREAM, STREAM_TOKENS, (STARTED_AFTER, started)))
        await started.wait()
        b = (await stream_chat(client, url, long_prompt, 8))["times"]
        a_times = (await a)["times"]
    sent, first = b[0], b[1]
    gaps = [(t1 - t0, t0) for t0, t1 in zip(a_times[1:], a_times[2:], strict=False)]
    during = [g for g, t0 in gaps if t0 < first and t0 + g > sent]
    return {"b_ttft_s": first - sent, "a_max_gap_during_b_s": max(during, default=0.0),
            "a_max_gap_s": max(g for g, _ in gaps), "a_chunks": len(a_times) - 1,
            "a_median_gap_s": sorted(g for g, _ in gaps)[len(gaps) // 2]}


def run(model: str, config: str, chunk: int) -> dict[str, Any]:
    os.environ["PREFILL_CHUNK_TOKENS"] = str(chunk)
    launcher = start_ours(model, config, "stall", LIMITS)
    try:
        row = asyncio.run(measure(launcher.url))
    finally:
        launcher.stop()
    ratio = row["a_max_gap_during_b_s"] / row["b_ttft_s"]
    print(f"  PREFILL_CHUNK_TOKENS={chunk}: B ttft {row['b_ttft_s']:.2f} s; A's longest gap while B prefilled "
          f"{row['a_max_gap_during_b_s']:.2f} s ({ratio:.2f}x B's ttft), median gap {row['a_median_gap_s']:.3f} s",
          flush=True)
    return {**row, "gap_over_ttft": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=QWEN_CODER_05B_ID)
    parser.add_argument("--config", default="bfloat16/verified", help="dtype/mode, as memory.py's --configs")
    parser.add_argument("--chunks", default="512,0", help="PREFILL_CHUNK_TOKENS values to compare")
    parser.add_argument("--out", default="long_prompt_stall")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows = {chunk: run(args.model, args.config, int(chunk)) for chunk in args.chunks.split(",")}
    write_results(args.out, {"model": args.model, "config": args.config, "stream": STREAM,
                             "stream_tokens": STREAM_TOKENS, "results": rows})


if __name__ == "__main__":
    sys.exit(main())
