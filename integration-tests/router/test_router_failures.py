"""Limits and failures on a real launcher: API key (401), overload (429), and a shard that dies
mid-generation (424 / stream error, launcher exits non-zero naming the shard)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from router_launcher import Launcher, start_launcher

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def server() -> Iterator[Launcher]:
    launcher = start_launcher(["--max-concurrent-requests", "2", "--api-key", KEY], "limits")
    yield launcher
    launcher.stop()


def generate(url: str, max_new: int, headers: dict[str, str] = AUTH) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new}}
    return httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)


def test_api_key_guards_generation_routes_only(server: Launcher) -> None:
    denied = generate(server.url, 2, headers={})
    assert denied.status_code == 401 and denied.content == b""
    wrong = generate(server.url, 2, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert chat.status_code == 401
    # The comparison is case-insensitive on the whole header, as upstream's.
    assert generate(server.url, 2, headers={"authorization": f"BEARER {KEY.upper()}"}).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/info").status_code == 200


def test_overload_answers_429_at_once(server: Launcher) -> None:
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: generate(server.url, 16), range(6)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes, codes
    assert set(codes) == {200, 429}
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'tgi_request_failure{err="overloaded"}' in metrics


def shard_pid(launcher_pid: int) -> int:
    """The launcher's `text-generation-server serve` child, found through /proc."""
    for child in Path(f"/proc/{launcher_pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in cmdline and any(b"text-generation-server" in part for part in cmdline):
                return int(pid)
    raise AssertionError("no shard child found")


def test_shard_death_fails_requests_and_launcher(server: Launcher) -> None:
    """Runs last: it ends this module's launcher."""
    first_token = threading.Event()
    stream_events: list[dict[str, object]] = []
    plain: list[httpx.Response] = []

    def streamer() -> None:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 400}}
        with httpx.stream("POST", f"{server.url}/generate_stream", json=body, headers=AUTH,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    stream_events.append(json.loads(line.removeprefix("data:")))
                    first_token.set()

    def blocking() -> None:
        plain.append(generate(server.url, 400))

    threads = [threading.Thread(target=streamer), threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    assert first_token.wait(120)
    os.kill(shard_pid(server.proc.pid), signal.SIGKILL)
    for t in threads:
        t.join(120)
    last = stream_events[-1]
    assert last.get("error_type") == "generation", last
    assert str(last["error"]).startswith("Request failed during generation: Server error: ")
    assert plain[0].status_code == 424, plain[0].text
    assert plain[0].json()["error_type"] == "generation"
    assert server.proc.wait(timeout=120) != 0
    assert "Shard 0 crashed" in server.log()
