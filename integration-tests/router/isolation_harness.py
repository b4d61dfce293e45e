"""Helpers of the request-isolation tests: raw HTTP calls with a watchdog, an innocent greedy
neighbour that keeps decoding while bad requests arrive, and the router's gauges."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WATCHDOG_S = 60.0  # "answers, does not hang": far above any real answer time here
NEIGHBOUR_PROMPT = "1, 2, 3, 4, 5,"
NEIGHBOUR_TOKENS = 40
MAX_CONCURRENT = 8
# Tiny limits keep every generation short (at most 63 tokens), so the fuzz stays bounded.
ISOLATION_LIMITS = ["--max-input-tokens", "48", "--max-total-tokens", "64", "--max-batch-prefill-tokens", "256",
                    "--max-concurrent-requests", str(MAX_CONCURRENT)]


@dataclass
class Answer:
    status: int
    text: str
    elapsed_s: float


def post(url: str, path: str, body: bytes | dict[str, object], *, stream: bool = False) -> Answer:
    """POST a body (raw bytes are sent as they are) and read the whole answer, under the watchdog."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    started = time.monotonic()
    with httpx.stream("POST", f"{url}{path}", content=content, headers=headers, timeout=WATCHDOG_S) as r:
        text = "".join(r.iter_text())
    return Answer(r.status_code, text, time.monotonic() - started)


def greedy_body(max_new_tokens: int) -> dict[str, object]:
    return {"inputs": NEIGHBOUR_PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}


def greedy_ids(url: str, max_new_tokens: int) -> list[int]:
    answer = post(url, "/generate", greedy_body(max_new_tokens))
    assert answer.status == 200, answer.text
    return [t["id"] for t in json.loads(answer.text)["details"]["tokens"]]


def stream_ids(url: str, max_new_tokens: int, started: threading.Event | None = None) -> list[int]:
    """The token ids of a greedy /generate_stream; sets `started` at the first token."""
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/generate_stream", json=greedy_body(max_new_tokens),
                      timeout=WATCHDOG_S) as r:
        for line in r.iter_lines():
            if not line or line.startswith(":"):  # a keep-alive comment on a slow step
                continue
            event = json.loads(line.removeprefix("data:"))
            assert "error" not in event, event
            ids.append(event["token"]["id"])
            if started is not None:
                started.set()
    return ids


@dataclass
class Neighbours:
    """Innocent greedy streams, one after the other, until stopped; each must equal `solo`."""

    url: str
    solo: list[int]
    runs: int = 0
    mismatches: list[list[int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    decoding: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Neighbours:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        assert self.decoding.wait(WATCHDOG_S), "the neighbour never started decoding"
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ids = stream_ids(self.url, len(self.solo), self.decoding)
            except (httpx.HTTPError, AssertionError) as err:
                self.errors.append(repr(err))
                continue
            self.runs += 1
            if ids != self.solo:
                self.mismatches.append(ids)

    def stop(self) -> None:
        """Stop after the current run and check every run."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join(WATCHDOG_S)
        assert not self._thread.is_alive(), "a neighbour stream hangs"
        assert not self.errors, self.errors
        assert self.runs >= 1 and not self.mismatches, (self.runs, self.mismatches, self.solo)


def metric(url: str, series: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=WATCHDOG_S).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def wait_idle(url: str) -> None:
    """Queue and running batch both empty, within the watchdog."""
    deadline = time.monotonic() + WATCHDOG_S
    while time.monotonic() < deadline:
        if metric(url, "tgi_queue_size") == 0 and metric(url, "tgi_batch_current_size") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the router did not become idle")


def assert_no_leaked_slots(url: str, max_concurrent_requests: int) -> None:
    """All the concurrency slots are free: as many concurrent requests as slots, none refused."""
    results: list[int] = []

    def one() -> None:
        results.append(post(url, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}).status)

    threads = [threading.Thread(target=one) for _ in range(max_concurrent_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WATCHDOG_S)
    assert results == [200] * max_concurrent_requests, results


def children(pid: int) -> list[int]:
    """Direct children of a process, read from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found.extend(int(p) for p in task.read_text().split())
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def raw_connection(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WATCHDOG_S)
