"""Mixed-traffic soak: every kind of request at once, for minutes, against one real launcher.

Method: one `text-generation-launcher` on the default model (loopback only, OMP_NUM_THREADS=2,
small limits: 256 input / 512 total / 512 prefill tokens, `--max-concurrent-requests 16`); any
flag this script does not know is passed to the launcher (`--speculate 2`,
`--layer-skip-mode verified --layer-skip-policy auto`, ...). `--clients` asyncio workers loop for
`--duration-s` seconds, each taking the next request kind (round-robin from its own offset, or
seeded-random with `--order random`) from KINDS: greedy /generate and /generate_stream, chat
completions streamed and not, seeded sampling (temperature 0.7, top_p 0.9), a per-request
`layer_skip: verified`, a JSON-schema and a regex grammar, invalid bodies that must be refused
with a 4xx (temperature -1, top_p 2, a string max_new_tokens, the regex `(unclosed`), requests we
cancel ourselves (a stream closed after its first token, a /generate that times out after 0.2 s),
a /vertex call of two instances, and valid but hostile ones: a temperature that overflows float32
(1e-37..1e-45, served), a JSON schema never seen before (compiled each time), one of 2,000
properties (refused by the shard's limits), a 500 KB prompt with truncate 8, /vertex with 60
instances (refused). Every HTTP call has a `--request-timeout-s` timeout; after a
429 a client waits 0.1-0.5 s (more clients than slots would otherwise spin on instant 429s).
Before the load, `--warmup-rounds` rounds (default 1) send each kind once, one at a time (a fresh
shard's first requests take seconds); they are counted with the rest. A thread GETs /health every
0.5 s (10 s timeout) throughout the load.

Each kind counts: sent, as expected, unexpected (status and body kept for the first few), 5xx
(or a stream's error event of a 5xx kind), refused with 429 (overloaded: not an error), cancelled
by us, and lost (no status, or a stream that ended without its final event). Afterwards: the
router must become idle (tgi_queue_size, tgi_batch_current_size, the router's
tgi_kv_blocks{state="used"} and the shard's kv_used 0), no concurrency slot may
leak (as many one-token requests as slots, no 429), and the router's own counters must balance
(tgi_request_count = tgi_request_success + tgi_request_failure over labels, as deltas over the
run); router and shard VmRSS at the start, after the warm-up, at the end and 12 s later (idle);
answers per window of time (10 s, or 60 s for runs of 5 minutes and more) and each kind's latency.

Writes benchmark/results/soak.json (`--out` to change); exits 1 when a request was lost, a 5xx or
an unexpected answer came, /health failed, the router did not become idle (within 300 s), a slot
leaked or the router's counters do not balance.

Usage: .venv/bin/python benchmark/soak.py [--duration-s 600] [--clients 6] [--order round-robin|random]
           [--seed 0] [--warmup-rounds 1] [--request-timeout-s 60] [--max-concurrent-requests 16]
           [--out PATH] [launcher flags, e.g. --speculate 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

# disconnect_load puts integration-tests/ and integration-tests/router/ on sys.path.
from disconnect_load import PROMPTS, child_pids, probe_slots, rss_mib, wait_idle
from isolation_harness import metric
from router_launcher import Launcher, start_launcher

from common import RESULTS, write_results

MIB = 2**20

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_CONCURRENT = 16
HEALTH_EVERY_S = 0.5
HEALTH_TIMEOUT_S = 10.0
CANCEL_AFTER_S = 0.2
SAMPLES_KEPT = 3
OVERLOAD_BACKOFF_S = (0.1, 0.5)
IDLE_SETTLE_S = 12.0  # more than two of the router's trim intervals
DRAIN_S = 120.0  # after the duration, the in-flight requests' bound
NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
COUNTED_SERIES = ("tgi_request_count", "tgi_request_success", "tgi_request_failure")


@dataclass
class KindTally:
    sent: int = 0
    expected: int = 0
    unexpected: int = 0
    server_errors: int = 0
    overloaded: int = 0
    cancelled: int = 0
    lost: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    ended_at: list[float] = field(default_factory=list)  # time.monotonic() of each answer

    def count(self, answer: Answer, latency_s: float) -> None:
        setattr(self, answer.outcome, getattr(self, answer.outcome) + 1)
        self.latencies_s.append(latency_s)
        self.ended_at.append(time.monotonic())
        self.statuses[answer.status] = self.statuses.get(answer.status, 0) + 1
        if answer.outcome in ("unexpected", "server_errors", "lost") and len(self.samples) < SAMPLES_KEPT:
            self.samples.append(f"{answer.status} {answer.detail[:200]}")

    def settle(self) -> None:
        """Requests sent that never ended (the watchdog stopped them) are lost too."""
        ended = self.expected + self.unexpected + self.server_errors + self.overloaded + self.cancelled + self.lost
        if self.sent > ended and len(self.samples) < SAMPLES_KEPT:
            self.samples.append(f"{self.sent - ended} requests never ended")
        self.lost += self.sent - ended

    def report(self) -> dict[str, Any]:
        """The counts, and the latency of the answers (any outcome) in ms, not every figure."""
        counts = {k: v for k, v in asdict(self).items() if k not in ("latencies_s", "ended_at")}
        return {**counts, "latency_ms": latency_ms(self.latencies_s)}


class Answer(NamedTuple):
    """How one request ended: `outcome` names a KindTally counter, `status` the HTTP status or
    what stood for it (`stream-end`, `stream-error`, `cut`, `timeout`, an exception's name)."""

    outcome: str
    status: str
    detail: str = ""


Send = Callable[[httpx.AsyncClient, random.Random], Awaitable[Answer]]


def nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def latency_ms(seconds: list[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    ordered = sorted(seconds)
    return {f"p{round(q * 100)}": round(nearest_rank(ordered, q) * 1000, 1) for q in (0.5, 0.99, 1.0)}


# --- answers -----------------------------------------------------------------------------------

def judge(status: int, body: str, want: str) -> Answer:
    """A whole answer: `want` is "200" or "4xx"; a 429 or a 5xx is its own outcome."""
    if status == 429:
        outcome = "overloaded"
    elif status >= 500:
        outcome = "server_errors"
    elif (want == "200" and status == 200) or (want == "4xx" and 400 <= status < 500):
        outcome = "expected"
    else:
        outcome = "unexpected"
    return Answer(outcome, str(status), body)


def stream_error(event: dict[str, Any]) -> Answer:
    """A stream's error event (native `{error, error_type}` or OpenAI `{error: {message, ...}}`):
    an overload, a 5xx kind (incomplete generation, shutdown) or unexpected."""
    error = event["error"]
    message = str(error.get("message") if isinstance(error, dict) else error)
    kind = str(event.get("error_type", ""))
    if kind == "overloaded" or message == "Model is overloaded":
        outcome = "overloaded"
    elif kind.startswith(("incomplete", "shutdown")) or message.startswith(("Incomplete", "Server is shutting")):
        outcome = "server_errors"
    else:
        outcome = "unexpected"
    return Answer(outcome, "stream-error", json.dumps(event))


async def post(client: httpx.AsyncClient, path: str, body: Any, want: str) -> Answer:
    r = await client.post(path, json=body)
    answer = judge(r.status_code, r.text, want)
    if answer.outcome == "expected" and want == "200" and not r.json():
        return answer._replace(outcome="unexpected")
    return answer


async def stream(client: httpx.AsyncClient, path: str, body: Any, cut_after_first: bool = False) -> Answer:
    """Read an SSE answer to its end: the native final event (generated_text set) or `[DONE]`;
    or, with `cut_after_first`, close the connection after the first token."""
    tokens = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return judge(r.status_code, (await r.aread()).decode(errors="replace"), "200")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and keep-alive comments
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return Answer("expected" if tokens else "unexpected", "stream-end", f"[DONE] after {tokens} events")
            event = json.loads(data)
            if "error" in event:
                return stream_error(event)
            tokens += 1
            if cut_after_first:
                return Answer("cancelled", "cut")  # leaving the block closes the connection mid-stream
            if event.get("generated_text") is not None:
                return Answer("expected", "stream-end")
    return Answer("lost", "stream-truncated", f"the stream ended without its final event after {tokens} events")


# --- request kinds -----------------------------------------------------------------------------

def generate_body(rng: random.Random, **parameters: Any) -> dict[str, Any]:
    return {"inputs": rng.choice(PROMPTS), "parameters": {"max_new_tokens": rng.randint(4, 12), **parameters}}


def chat_body(rng: random.Random, streamed: bool) -> dict[str, Any]:
    question = rng.choice(["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three."])
    return {"messages": [{"role": "user", "content": question}], "max_tokens": rng.randint(4, 12),
            "temperature": 0, "stream": streamed}


async def greedy(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    return await post(c, "/generate", generate_body(rng), "200")


async def greedy_stream(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    return await stream(c, "/generate_stream", generate_body(rng))


async def chat(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    return await post(c, "/v1/chat/completions", chat_body(rng, False), "200")


async def chat_stream(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    return await stream(c, "/v1/chat/completions", chat_body(rng, True))


async def sampled(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    body = generate_body(rng, do_sample=True, temperature=0.7, top_p=0.9, seed=rng.randint(0, 2**31))
    return await post(c, "/generate", body, "200")


async def layer_skip_verified(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    return await post(c, "/generate", generate_body(rng, layer_skip="verified"), "200")


async def grammar_json(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    body = generate_body(rng, grammar={"type": "json", "value": NAME_SCHEMA})
    body["parameters"]["max_new_tokens"] = 16
    return await post(c, "/generate", body, "200")


async def grammar_regex(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    return await post(c, "/generate", generate_body(rng, grammar={"type": "regex", "value": "[A-Z][a-z]{2,8}"}),
                      "200")


def refused(**parameters: Any) -> Send:
    """A /generate whose parameters must be refused with a 4xx."""
    async def send(c: httpx.AsyncClient, rng: random.Random) -> Answer:
        body = generate_body(rng)
        body["parameters"].update(parameters)
        return await post(c, "/generate", body, "4xx")
    return send


async def cancel_stream(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    body = generate_body(rng)
    body["parameters"]["max_new_tokens"] = 32
    return await stream(c, "/generate_stream", body, cut_after_first=True)


async def cancel_generate(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    body = generate_body(rng)
    body["parameters"]["max_new_tokens"] = 64
    try:
        r = await c.post("/generate", json=body, timeout=CANCEL_AFTER_S)
    except httpx.TimeoutException:
        return Answer("cancelled", "timeout")
    return judge(r.status_code, r.text, "200")  # answered before we gave up: fine too


async def vertex(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    instances = [{"inputs": rng.choice(PROMPTS), "parameters": {"max_new_tokens": 4}} for _ in range(2)]
    r = await c.post("/vertex", json={"instances": instances})
    answer = judge(r.status_code, r.text, "200")
    if answer.outcome == "expected" and len(r.json().get("predictions", [])) != 2:
        return answer._replace(outcome="unexpected")
    return answer


async def extreme_temperature(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    """Valid but overflowing float32 (served as its greedy limit)."""
    body = generate_body(rng, do_sample=True, temperature=rng.choice([1e-37, 1e-38, 1e-45]), top_p=0.9,
                         seed=rng.randint(0, 2**31))
    return await (stream(c, "/generate_stream", body) if rng.random() < 0.5 else post(c, "/generate", body, "200"))


async def fresh_grammar(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    """A schema never seen before (a real compile each time, 10-60 properties)."""
    names = [f"f{rng.randint(0, 10**9)}" for _ in range(rng.randint(10, 60))]
    schema = {"type": "object", "properties": {n: {"type": "string"} for n in names}}
    body = generate_body(rng, grammar={"type": "json", "value": schema})
    return await post(c, "/generate", body, "200")


async def huge_grammar(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    """2,000 optional properties: refused by the shard's limits, fast."""
    schema = {"type": "object", "properties": {f"p{i}_{rng.randint(0, 9)}": {"type": "string"} for i in range(2000)}}
    return await post(c, "/generate", generate_body(rng, grammar={"type": "json", "value": schema}), "4xx")


async def truncated_prompt(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    """A 500 KB prompt with truncate 8: the shard gets the text of 8 tokens."""
    body = generate_body(rng, truncate=8)
    body["inputs"] = "word " * 100_000
    return await post(c, "/generate", body, "200")


async def vertex_too_many(c: httpx.AsyncClient, rng: random.Random) -> Answer:
    """More instances than --max-client-batch-size (4): refused."""
    instances = [{"inputs": rng.choice(PROMPTS), "parameters": {"max_new_tokens": 4}} for _ in range(60)]
    r = await c.post("/vertex", json={"instances": instances})
    return judge(r.status_code, r.text, "4xx")


KINDS: dict[str, Send] = {
    "generate": greedy,
    "generate_stream": greedy_stream,
    "chat": chat,
    "chat_stream": chat_stream,
    "sampled": sampled,
    "layer_skip_verified": layer_skip_verified,
    "grammar_json": grammar_json,
    "grammar_regex": grammar_regex,
    "invalid_temperature": refused(temperature=-1),
    "invalid_top_p": refused(do_sample=True, top_p=2),
    "invalid_type": refused(max_new_tokens="ten"),
    "invalid_regex": refused(grammar={"type": "regex", "value": "(unclosed"}),
    "cancel_stream": cancel_stream,
    "cancel_generate": cancel_generate,
    "vertex": vertex,
    "extreme_temperature": extreme_temperature,
    "fresh_grammar": fresh_grammar,
    "huge_grammar": huge_grammar,
    "truncated_prompt": truncated_prompt,
    "vertex_too_many": vertex_too_many,
}


# --- load --------------------------------------------------------------------------------------

async def send_one(client: httpx.AsyncClient, rng: random.Random, kind: str, tally: KindTally) -> Answer:
    tally.sent += 1
    started = time.monotonic()
    try:
        answer = await KINDS[kind](client, rng)
    except httpx.HTTPError as err:  # no answer within the timeout, or the connection broke
        answer = Answer("lost", type(err).__name__, str(err))
    except (ValueError, KeyError, AttributeError) as err:  # an answer that is not the JSON it should be
        answer = Answer("unexpected", type(err).__name__, str(err))
    tally.count(answer, time.monotonic() - started)
    return answer


async def warm_up(tallies: dict[str, KindTally], url: str, rounds: int, timeout_s: float) -> None:
    """Each kind `rounds` times, one at a time: the first requests of a fresh shard are slow."""
    rng = random.Random(-1)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        for _ in range(rounds):
            for kind in KINDS:
                await send_one(client, rng, kind, tallies[kind])


async def run_clients(tallies: dict[str, KindTally], url: str, clients: int, duration_s: float, order: str,
                      seed: int, timeout_s: float) -> bool:
    """Send the mix until `duration_s` is over and the last answers are in; False when the
    watchdog had to stop requests still waiting (they count as lost)."""
    names = list(KINDS)
    stop_at = time.monotonic() + duration_s
    max_per_client = int(duration_s * 100) + 1  # a bound on the count, far above what a client sends
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
            for n in range(max_per_client):
                if time.monotonic() >= stop_at:
                    return
                kind = rng.choice(names) if order == "random" else names[(index + n) % len(names)]
                answer = await send_one(client, rng, kind, tallies[kind])
                if answer.outcome == "overloaded":  # as a client would: back off rather than spin on 429s
                    await asyncio.sleep(rng.uniform(*OVERLOAD_BACKOFF_S))

    try:
        await asyncio.wait_for(asyncio.gather(*(client_loop(i) for i in range(clients))),
                               duration_s + timeout_s + DRAIN_S)
    except asyncio.TimeoutError:
        return False
    finally:
        for tally in tallies.values():
            tally.settle()
    return True


@dataclass
class HealthProbe:
    """GET /health every HEALTH_EVERY_S in a thread of its own, until stopped."""

    url: str
    latencies_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, max_probes: int) -> HealthProbe:
        self._thread = threading.Thread(target=self._loop, args=(max_probes,), daemon=True)
        self._thread.start()
        return self

    def _loop(self, max_probes: int) -> None:
        with httpx.Client(base_url=self.url, timeout=HEALTH_TIMEOUT_S) as client:
            for _ in range(max_probes):
                started = time.monotonic()
                try:
                    status = client.get("/health").status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                except httpx.HTTPError as err:
                    self.failures.append(f"{type(err).__name__}: {err}")
                self.latencies_s.append(time.monotonic() - started)
                if self._stop.wait(max(0.0, HEALTH_EVERY_S - (time.monotonic() - started))):
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(HEALTH_TIMEOUT_S * 2)

    def summary(self) -> dict[str, Any]:
        ms = latency_ms(self.latencies_s) or {}
        return {"probes": len(self.latencies_s), "failures": len(self.failures),
                "failure_samples": self.failures[:5], "max_ms": ms.get("p100"), "p99_ms": ms.get("p99"),
                "p50_ms": ms.get("p50")}


# --- the router's side -------------------------------------------------------------------------

def request_counters(url: str) -> dict[str, float]:
    """tgi_request_count, _success and every tgi_request_failure{err=...} series, from /metrics."""
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=HEALTH_TIMEOUT_S).text.splitlines():
        if line.startswith(COUNTED_SERIES):
            series, value = line.rsplit(" ", 1)
            found[series] = float(value)
    return found


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The run's share of the router's counters, and how many counted requests ended neither way."""
    delta = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
    failures = sum(v for k, v in delta.items() if k.startswith("tgi_request_failure"))
    count = delta.get("tgi_request_count", 0.0)
    success = delta.get("tgi_request_success", 0.0)
    return {"deltas": delta, "unaccounted": count - success - failures}


def client_vs_router(tallies: dict[str, KindTally], deltas: dict[str, float]) -> dict[str, list[float]]:
    """[what the clients saw, what the router counted] for successes, 429s and cancelled requests.

    They can differ by a race only (a cancel that came as the answer was written); a body the
    router cannot parse (invalid_type) is refused before it is counted at all.
    """
    seen = {"success": 0, "overloaded": 0, "dropped": 0}
    for t in tallies.values():
        seen["success"] += t.statuses.get("200", 0) + t.statuses.get("stream-end", 0)
        seen["overloaded"] += t.overloaded
        seen["dropped"] += t.cancelled
    counted = {"success": deltas.get("tgi_request_success", 0.0),
               "overloaded": deltas.get('tgi_request_failure{err="overloaded"}', 0.0),
               "dropped": deltas.get('tgi_request_failure{err="dropped"}', 0.0)}
    return {k: [seen[k], counted[k]] for k in seen}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def argv_of(launcher: Launcher) -> list[str]:
    args = launcher.proc.args
    return [str(x) for x in args] if isinstance(args, list) else [str(args)]


def log_errors(launcher: Launcher) -> list[str]:
    """The first lines of the launcher's log that report an error or a traceback."""
    lines = [line for line in launcher.log().splitlines() if "ERROR" in line or "Traceback" in line]
    return [line[:300] for line in lines[:10]]


# --- report ------------------------------------------------------------------------------------

def answers_per_window(tallies: dict[str, KindTally], started: float, window_s: float) -> list[int]:
    """Answers of the load (warm-up excluded) in each window of `window_s` since it started."""
    windows: dict[int, int] = {}
    for t in tallies.values():
        for at in t.ended_at:
            if at >= started:
                n = int((at - started) // window_s)
                windows[n] = windows.get(n, 0) + 1
    return [windows.get(n, 0) for n in range(max(windows, default=-1) + 1)]


def totals(tallies: dict[str, KindTally]) -> dict[str, int]:
    keys = ("sent", "expected", "unexpected", "server_errors", "overloaded", "cancelled", "lost")
    return {k: sum(getattr(t, k) for t in tallies.values()) for k in keys}


def print_summary(result: dict[str, Any]) -> None:
    print(f"{'kind':<22}{'sent':>6}{'ok':>6}{'unexp':>7}{'5xx':>5}{'429':>5}{'cancel':>8}{'lost':>6}"
          f"{'p50 ms':>9}{'max ms':>9}")
    for kind, t in result["kinds"].items():
        ms = t["latency_ms"] or {"p50": "-", "p100": "-"}
        print(f"{kind:<22}{t['sent']:>6}{t['expected']:>6}{t['unexpected']:>7}{t['server_errors']:>5}"
              f"{t['overloaded']:>5}{t['cancelled']:>8}{t['lost']:>6}{ms['p50']:>9}{ms['p100']:>9}")
        for sample in t["samples"]:
            print(f"    {sample}")
    h, rss = result["health"], result["rss_mib"]
    print(f"answers per {result['window_s']} s: {result['answers_per_window']}")
    print(f"health: {h['probes']} probes, {h['failures']} failures, p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, "
          f"max {h['max_ms']} ms")
    for name in rss["before"]:
        print(f"RSS {name}: {rss['before'][name]} (start) -> {rss['after_warmup'][name]} (warm) "
              f"-> {rss['after'][name]} (end) -> {rss['after_idle'][name]} MiB ({IDLE_SETTLE_S:g} s idle)")
    print(f"gauges after: {result['gauges_after']}; leaked slots: {result['leaked_slots']}; "
          f"router counters unaccounted: {result['router_counters']['unaccounted']}")
    print(f"[client, router] counts: {result['client_vs_router']}")
    for line in result["launcher_log_errors"]:
        print(f"  log: {line}")


def failed_checks(result: dict[str, Any]) -> list[str]:
    t, failed = result["totals"], []
    for key in ("lost", "server_errors", "unexpected"):
        if t[key]:
            failed.append(f"{t[key]} {key}")
    if result["health"]["failures"]:
        failed.append(f"{result['health']['failures']} /health failures")
    gauges = result["gauges_after"]
    if (gauges["tgi_queue_size"] or gauges["tgi_batch_current_size"] or gauges["kv_used_mib"]
            or gauges["kv_blocks_used"]):
        failed.append(f"not idle: {gauges}")
    if not result["clients_finished"]:
        failed.append("the watchdog stopped requests still waiting")
    if result["leaked_slots"]:
        failed.append(f"{result['leaked_slots']} leaked slots")
    if result["router_counters"]["unaccounted"]:
        failed.append(f"{result['router_counters']['unaccounted']} requests the router counted but never ended")
    return failed


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False,
                                     epilog="Other flags are passed to text-generation-launcher.")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--order", choices=["round-robin", "random"], default="round-robin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="each kind, one at a time, before the load")
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--max-concurrent-requests", type=int, default=MAX_CONCURRENT)
    parser.add_argument("--out", default=str(RESULTS / "soak.json"))
    parser.add_argument("--verified", action="store_true",
                        help="serve in verified mode with the tests' policy for the default model "
                             "(6 of 30 layers skipped to draft; forced drafting is not set)")
    return parser.parse_known_args()


def verified_flags(model_id: str, folder: Path) -> list[str]:
    """Launcher flags for verified mode with the tests' six-layer policy (written for `model_id`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from text_generation_server.download import download_weights
    from text_generation_server.models.loading import LoadConfig, load_model

    from policies import SIX_LAYERS, write_policy

    model = load_model(download_weights(model_id), LoadConfig())
    policy = write_policy(model, folder / "policy.json", SIX_LAYERS)
    return ["--layer-skip-mode", "verified", "--layer-skip-policy", str(policy)]


def main() -> int:
    a, passthrough = parse_args()
    if a.verified:
        passthrough += verified_flags(a.model_id, Path(tempfile.mkdtemp(prefix="soak-policy-")))
    flags = ["--model-id", a.model_id, "--max-concurrent-requests", str(a.max_concurrent_requests), *passthrough]
    launcher = start_launcher(flags, "soak")
    try:
        pids = child_pids(launcher.proc.pid)
        rss = {"before": {name: round(rss_mib(pid), 1) for name, pid in pids.items()}}
        counters_before = request_counters(launcher.url)
        tallies = {kind: KindTally() for kind in KINDS}
        asyncio.run(warm_up(tallies, launcher.url, a.warmup_rounds, a.request_timeout_s))
        rss["after_warmup"] = {name: round(rss_mib(pid), 1) for name, pid in pids.items()}
        health = HealthProbe(launcher.url).start(int(a.duration_s / HEALTH_EVERY_S) + 1000)
        started = time.monotonic()
        try:
            finished = asyncio.run(run_clients(tallies, launcher.url, a.clients, a.duration_s, a.order, a.seed,
                                               a.request_timeout_s))
        finally:
            health.stop()
        wall_s = time.monotonic() - started
        queue, batch = wait_idle(launcher.url)
        counters_after = request_counters(launcher.url)  # before the slot probe adds its own requests
        leaked = asyncio.run(probe_slots(launcher.url, a.max_concurrent_requests))
        rss["after"] = {name: round(rss_mib(pid), 1) for name, pid in pids.items()}
        time.sleep(IDLE_SETTLE_S)  # the router gives freed memory back once idle (memory.py)
        rss["after_idle"] = {name: round(rss_mib(pid), 1) for name, pid in pids.items()}
        gauges = {"tgi_queue_size": queue, "tgi_batch_current_size": batch,
                  "tgi_batch_current_max_tokens": metric(launcher.url, "tgi_batch_current_max_tokens"),
                  "kv_blocks_used": metric(launcher.url, 'tgi_kv_blocks{state="used"}'),
                  **{f"{part}_mib": round(metric(launcher.url, f'tgi_shard_memory_bytes{{part="{part}"}}') / MIB, 1)
                     for part in ("kv", "kv_used")}}
    finally:
        exit_code = launcher.stop()
    window_s = 60 if a.duration_s >= 300 else 10
    counters = counter_deltas(counters_before, counters_after)
    result = {
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))},
        "flags": passthrough, "launcher_argv": argv_of(launcher),
        "clients": a.clients, "clients_finished": finished, "order": a.order, "seed": a.seed,
        "duration_s": a.duration_s, "warmup_rounds": a.warmup_rounds, "wall_s": round(wall_s, 1),
        "totals": totals(tallies), "window_s": window_s,
        "answers_per_window": answers_per_window(tallies, started, window_s),
        "kinds": {kind: t.report() for kind, t in tallies.items()},
        "health": health.summary(), "rss_mib": rss,
        "gauges_after": gauges, "leaked_slots": leaked,
        "router_counters": counters, "client_vs_router": client_vs_router(tallies, counters["deltas"]),
        "lost_requests": totals(tallies)["lost"],
        "launcher_exit_code": exit_code, "launcher_log": str(launcher.log_path),
        "launcher_log_errors": log_errors(launcher),
    }
    write_results(a.out, result)
    print_summary(result)
    failed = failed_checks(result)
    print("PASS" if not failed else "FAIL: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
