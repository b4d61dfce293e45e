"""Lifecycle of requests on a real launcher: a client that disconnects has its request dropped on
every route (counted as dropped, its slot freed), and SIGTERM lets in-flight requests finish or
ends them with an error event at --graceful-termination-timeout."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from isolation_harness import WATCHDOG_S, assert_no_leaked_slots, metric, raw_connection, wait_idle
from router_launcher import Launcher, start_launcher

MAX_CONCURRENT = 4
GRACEFUL_S = 10
LONG = 1500  # new tokens: far more than GRACEFUL_S seconds of decoding on these CPUs


@pytest.fixture(scope="module")
def server() -> Iterator[Launcher]:
    launcher = start_launcher(["--max-concurrent-requests", str(MAX_CONCURRENT), "--max-total-tokens", "2048",
                               "--graceful-termination-timeout", str(GRACEFUL_S)], "lifecycle")
    yield launcher
    launcher.stop()


def _body(route: str, stream: bool) -> dict[str, object]:
    if route == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "Count to one thousand."}], "max_tokens": LONG,
                "temperature": 0, "stream": stream}
    if route == "/v1/completions":
        return {"prompt": "1, 2, 3,", "max_tokens": LONG, "temperature": 0, "stream": stream}
    body: dict[str, object] = {"inputs": "1, 2, 3,", "parameters": {"max_new_tokens": LONG}}
    if route == "/":
        body["stream"] = stream
    return body


CASES = [("/generate", False), ("/generate_stream", True), ("/", False), ("/", True),
         ("/v1/chat/completions", False), ("/v1/chat/completions", True),
         ("/v1/completions", False), ("/v1/completions", True)]


def _wait_running(url: str) -> None:
    deadline = time.monotonic() + WATCHDOG_S
    while metric(url, "tgi_batch_current_size") < 1:
        assert time.monotonic() < deadline, "the request never reached the batch"
        time.sleep(0.1)


@pytest.mark.parametrize(("route", "stream"), CASES)
def test_a_disconnected_client_is_dropped(server: Launcher, route: str, stream: bool) -> None:
    wait_idle(server.url)
    dropped = metric(server.url, 'tgi_request_failure{err="dropped"}')
    success = metric(server.url, "tgi_request_success")
    body = json.dumps(_body(route, stream)).encode()
    with raw_connection(server.port) as conn:
        conn.sendall(b"POST " + route.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if stream:
            received = b""
            while b"data:" not in received:  # headers, then a first token
                chunk = conn.recv(4096)
                assert chunk, "the stream closed before its first token"
                received += chunk
        else:
            _wait_running(server.url)
    wait_idle(server.url)  # the batch lets the request go at its next step
    assert metric(server.url, 'tgi_request_failure{err="dropped"}') == dropped + 1
    assert metric(server.url, "tgi_request_success") == success


def test_slots_are_free_after_the_disconnects(server: Launcher) -> None:
    assert_no_leaked_slots(server.url, MAX_CONCURRENT)


def _stream(url: str, max_new_tokens: int, events: list[dict[str, object]], started: threading.Event) -> None:
    body = {"inputs": "1, 2, 3,", "parameters": {"max_new_tokens": max_new_tokens}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=WATCHDOG_S) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line.removeprefix("data:")))
                started.set()


def test_sigterm_lets_in_flight_requests_finish_or_end_them_at_the_deadline(server: Launcher) -> None:
    """Runs last: it ends this module's launcher."""
    long_events: list[dict[str, object]] = []
    short_events: list[dict[str, object]] = []
    threads = []
    for max_new, events in ((LONG, long_events), (2, short_events)):  # short: one step left
        started = threading.Event()
        thread = threading.Thread(target=_stream, args=(server.url, max_new, events, started))
        thread.start()
        assert started.wait(WATCHDOG_S)
        threads.append(thread)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:
        refused = httpx.post(f"{server.url}/generate", json={"inputs": "Hi"}, timeout=WATCHDOG_S).status_code
    except httpx.ConnectError:
        refused = 0  # the listener is closed
    assert refused in (0, 503), refused
    for thread in threads:
        thread.join(WATCHDOG_S)
        assert not thread.is_alive(), "a stream hangs after SIGTERM"
    ended = time.monotonic() - signalled
    assert short_events[-1].get("generated_text") is not None, short_events[-1]
    last = long_events[-1]
    assert last.get("error_type") == "shutdown", last
    assert f"graceful termination timeout ({GRACEFUL_S} s)" in str(last["error"])
    assert server.proc.wait(WATCHDOG_S) == 0, server.log()[-2000:]
    print(f"in-flight stream ended {ended:.1f} s after SIGTERM (timeout {GRACEFUL_S} s)")
