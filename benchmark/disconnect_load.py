"""Load test of request isolation: concurrent streams, a fifth of them cut off mid-stream.

Method: one real `text-generation-launcher` on the default model (loopback only, OMP_NUM_THREADS=2).
`--clients` asyncio clients loop for `--duration-s` seconds, each sending greedy
/generate_stream requests (max_new_tokens drawn from 8..48); with probability
`--disconnect-ratio` a client closes its connection after a random number of tokens. Then no new
request starts; the in-flight ones finish (bounded by the watchdog). Afterwards:
- tgi_queue_size and tgi_batch_current_size must read 0;
- every request that was not cut off must have ended with its final event, a finish reason of
  `length` (exactly max_new_tokens tokens) or `eos_token`, and as many token events as tokens;
- leaked slots: as many concurrent one-token requests as `--max-concurrent-requests`, counting
  the 429s (0 means every slot came back);
- router and shard RSS (VmRSS) before and after the load.
Writes benchmark/results/disconnect_load.json; exits 1 when a check fails.

Usage: .venv/bin/python benchmark/disconnect_load.py [--clients 64] [--duration-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

INTEGRATION_TESTS = Path(__file__).resolve().parent.parent / "integration-tests"
sys.path[:0] = [str(INTEGRATION_TESTS / "router"), str(INTEGRATION_TESTS)]
from isolation_harness import children, metric  # noqa: E402
from router_launcher import start_launcher  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "disconnect_load.json"
PROMPTS = ["1, 2, 3, 4, 5,", "def fibonacci(n):", "The three primary colors are", "Once upon a time,"]
WATCHDOG_S = 300.0


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    disconnected: int = 0
    overloaded: int = 0
    bad_endings: list[str] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    tokens: int = 0


async def one_request(client: httpx.AsyncClient, rng: random.Random, cut: bool, tally: Tally) -> None:
    max_new = rng.randint(8, 48)
    cut_after = rng.randint(1, max_new - 1) if cut else None
    body = {"inputs": rng.choice(PROMPTS), "parameters": {"max_new_tokens": max_new, "details": True}}
    tally.started += 1
    count = 0
    async with client.stream("POST", "/generate_stream", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line.removeprefix("data:"))
            if "error" in event:
                kind = "overloaded" if event.get("error_type") == "overloaded" else "error"
                if kind == "overloaded":
                    tally.overloaded += 1
                else:
                    tally.bad_endings.append(str(event))
                return
            count += 1
            tally.tokens += 1
            if cut_after is not None and count >= cut_after:
                tally.disconnected += 1
                return  # leaving the block closes the connection mid-stream
            if event["generated_text"] is not None:
                details = event["details"]
                reason = details["finish_reason"]
                tally.finish_reasons[reason] = tally.finish_reasons.get(reason, 0) + 1
                good = (reason == "length" and details["generated_tokens"] == max_new) or reason == "eos_token"
                if not good or details["generated_tokens"] != count:
                    tally.bad_endings.append(f"{reason} after {count}/{max_new} tokens: {details}")
                tally.completed += 1
                return
    tally.bad_endings.append(f"stream ended without its final event after {count} tokens")


async def run_clients(url: str, clients: int, duration_s: float, ratio: float, seed: int) -> Tally:
    tally = Tally()
    stop_at = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=url, timeout=WATCHDOG_S, limits=limits) as client:
            while time.monotonic() < stop_at:
                await one_request(client, rng, rng.random() < ratio, tally)

    await asyncio.wait_for(asyncio.gather(*(client_loop(i) for i in range(clients))), duration_s + WATCHDOG_S)
    return tally


async def probe_slots(url: str, slots: int) -> int:
    """429s among `slots` concurrent one-token requests: the slots that did not come back."""
    async with httpx.AsyncClient(base_url=url, timeout=WATCHDOG_S,
                                 limits=httpx.Limits(max_connections=slots + 8)) as client:
        answers = await asyncio.gather(*(
            client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}})
            for _ in range(slots)))
    return sum(1 for a in answers if a.status_code == 429)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def child_pids(launcher_pid: int) -> dict[str, int]:
    named = {}
    for pid in children(launcher_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        named["router" if b"text-generation-router" in cmdline else "shard"] = pid
    return named


def wait_idle(url: str) -> tuple[float, float]:
    deadline = time.monotonic() + WATCHDOG_S
    while True:
        queue, batch = metric(url, "tgi_queue_size"), metric(url, "tgi_batch_current_size")
        if (queue, batch) == (0, 0) or time.monotonic() > deadline:
            return queue, batch
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--disconnect-ratio", type=float, default=0.2)
    parser.add_argument("--max-concurrent-requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    launcher = start_launcher(["--max-concurrent-requests", str(a.max_concurrent_requests)], "load")
    try:
        pids = child_pids(launcher.proc.pid)
        rss_before = {name: rss_mib(pid) for name, pid in pids.items()}
        started = time.monotonic()
        tally = asyncio.run(run_clients(launcher.url, a.clients, a.duration_s, a.disconnect_ratio, a.seed))
        wall_s = time.monotonic() - started
        queue, batch = wait_idle(launcher.url)
        leaked = asyncio.run(probe_slots(launcher.url, a.max_concurrent_requests))
        rss_after = {name: rss_mib(pid) for name, pid in pids.items()}
        dropped = metric(launcher.url, 'tgi_request_failure{err="dropped"}')
    finally:
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.proc.wait(WATCHDOG_S)
    result = {
        "clients": a.clients, "duration_s": a.duration_s, "disconnect_ratio": a.disconnect_ratio,
        "wall_s": round(wall_s, 1), **asdict(tally), "dropped_metric": dropped,
        "queue_size_after": queue, "batch_current_size_after": batch, "leaked_slots": leaked,
        "rss_mib_before": {k: round(v) for k, v in rss_before.items()},
        "rss_mib_after": {k: round(v) for k, v in rss_after.items()},
        "tokens_per_s": round(tally.tokens / wall_s, 1),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = not tally.bad_endings and (queue, batch) == (0, 0) and leaked == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
