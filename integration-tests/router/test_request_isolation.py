"""Request isolation on a real launcher: one bad request fails alone, fast, and nothing else is lost.

Every case is answered (4xx naming the field, or 200), never with a 5xx, never hanging, while an
innocent greedy neighbour keeps decoding and returns its solo tokens. The last test SIGKILLs the
launcher and checks that its shard and router die with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from isolation_harness import (
    ISOLATION_LIMITS,
    MAX_CONCURRENT,
    NEIGHBOUR_TOKENS,
    WATCHDOG_S,
    Answer,
    Neighbours,
    alive,
    assert_no_leaked_slots,
    children,
    post,
    raw_connection,
    wait_idle,
)
from router_launcher import Launcher, start_launcher

from text_generation_router.config import ServingLimits
from text_generation_router.engine.batcher import Batcher, Health
from text_generation_router.engine.client import ShardClient
from text_generation_router.engine.events import ErrorEvent, InferEvent, TokenEvent
from text_generation_router.engine.handshake import ShardInfo
from text_generation_router.engine.metrics import build_metrics
from text_generation_router.engine.queue import Queue
from text_generation_router.engine.schemas import GenerateParameters
from text_generation_router.engine.validation import ValidRequest, build_valid_request

GENERATE_ROUTES = ["/generate", "/generate_stream", "/"]
ALL_BODY_ROUTES = [*GENERATE_ROUTES, "/v1/chat/completions", "/v1/completions", "/tokenize"]
SURROGATE = b'"\\ud800"'


def _inputs_body(route: str, raw_text: bytes) -> bytes:
    """A body of `route` whose prompt is the given raw JSON string literal."""
    if route == "/v1/chat/completions":
        return b'{"messages":[{"role":"user","content":' + raw_text + b'}],"max_tokens":2}'
    if route == "/v1/completions":
        return b'{"prompt":' + raw_text + b',"max_tokens":2}'
    return b'{"inputs":' + raw_text + b',"parameters":{"max_new_tokens":2}}'


def _generate(params: str) -> bytes:
    return b'{"inputs":"Hello","parameters":{"max_new_tokens":2,' + params.encode() + b"}}"


def _properties(count: int) -> dict[str, object]:
    """An object schema of `count` optional string properties (its compile time grows ~cubically)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(count)}}


def _chat(fields: str) -> bytes:
    return b'{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,' + fields.encode() + b"}"


# (route, body, expected status, text the answer must contain), from the issue's report.
ISSUE_CASES: list[tuple[str, bytes, int, str]] = [
    ("/generate", _generate('"seed":18446744073709551616'), 422, "parameters.seed"),
    ("/generate", _generate('"top_k":4294967296'), 422, "parameters.top_k"),
    ("/generate", _generate('"grammar":{"type":"regex","value":"(unclosed"}'), 422,
     "grammar is not valid: regex grammar does not compile"),  # refused by the shard, alone
    ("/generate", _generate('"grammar":{"type":"json","value":{"properties":{"a":{"type":"nonsense"}}}}'), 422,
     "grammar is not valid: 'nonsense' is not valid"),  # the JSON Schema meta-schema, in the router
    ("/generate", _generate('"temperature":NaN'), 422, "parameters.temperature"),
    ("/generate", _generate('"temperature":Infinity'), 422, "parameters.temperature"),
    ("/generate", _generate('"repetition_penalty":-Infinity'), 422, "parameters.repetition_penalty"),
    ("/generate", _generate('"repetition_penalty":1e400'), 422, "parameters.repetition_penalty"),
    ("/generate", _generate('"stop":["\\ud800"]'), 400, "parameters.stop.0"),
    ("/generate", _generate('"adapter_id":"\\udfff"'), 400, "parameters.adapter_id"),
    ("/generate", b'{"inputs":"Hello","add_special_tokens":"yes"}', 422, "add_special_tokens"),
    ("/generate", b'{"inputs":"Hello\xff"}', 400, "UTF-8"),
    ("/generate", b'{"inputs":"' + b"a" * 2_100_000 + b'"}', 413, "length limit exceeded"),
    ("/tokenize", b'{"inputs":"' + b"word " * 200 + b'"}', 422, "`inputs` must have less than 48 tokens"),
    ("/v1/chat/completions", _chat('"max_tokens":-1'), 422, "max_tokens"),
    ("/v1/chat/completions", _chat('"max_completion_tokens":-1'), 422, "max_completion_tokens"),
    ("/v1/chat/completions", _chat('"seed":-1'), 422, "seed"),
    ("/v1/chat/completions", _chat('"top_logprobs":-1,"logprobs":true'), 422, "top_logprobs"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":[{"type":"text","text":5}]}]}', 422,
     "messages.0.content.0.text"),
    ("/v1/chat/completions", _chat('"response_format":{"type":"json_schema","json_schema":{"name":"x"}}'), 422,
     "missing field `schema`"),
    ("/v1/chat/completions", _chat('"tools":[{"function":{"name":"f"}}],"tool_choice":"g"'), 422,
     "Tool with name g not found"),
    ("/v1/completions", b'{"prompt":"Hi","max_tokens":-1}', 422, "max_tokens"),
    ("/v1/completions", b'{"prompt":"Hi","max_tokens":2,"stop":["a\\u0000b"]}', 200, "text_completion"),
    # Valid but hostile (the second issue's report): each is served or refused alone, fast.
    ("/generate_stream", _generate('"temperature":1e-37,"top_p":0.9,"seed":3'), 200, '"generated_text"'),
    ("/generate", _generate('"temperature":1e-38,"typical_p":0.5,"seed":3'), 200, '"generated_text"'),
    ("/generate", _generate('"temperature":1e-45,"top_k":3,"do_sample":true'), 200, '"generated_text"'),
    ("/generate", _generate('"temperature":1e-50'), 422, "`temperature` must be strictly positive"),  # 0 as f32
    ("/generate", _generate('"top_p":1e-50'), 422, "`top_p` must be > 0.0"),
    ("/generate", _generate('"temperature":3.4e38'), 200, '"generated_text"'),
    ("/generate", _generate('"grammar":{"type":"json","value":' + json.dumps(_properties(2000)) + "}"), 422,
     "an object of the JSON schema has 2000 properties; this server compiles at most 256"),
    ("/v1/chat/completions", _chat('"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":'
                                   + json.dumps(_properties(20000)) + "}}"), 422,
     "bytes; this server compiles at most 65536"),
    ("/generate", _generate('"truncate":8').replace(b'"Hello"', b'"' + b"word " * 100_000 + b'"'),
     200, '"generated_text"'),
    ("/vertex", json.dumps({"instances": [{"inputs": "Hi", "parameters": {"max_new_tokens": 2}}] * 5}).encode(), 422,
     "5 instances; the maximum allowed batch size (--max-client-batch-size) is 4"),
    *[(route, _inputs_body(route, SURROGATE), 400, "lone surrogate") for route in ALL_BODY_ROUTES],
    *[(route, b"[" * 5000 + b"]" * 5000, 400, "recursion limit") for route in ALL_BODY_ROUTES],
]


def _check(answer: Answer, status: int, piece: str, what: object) -> None:
    assert answer.status == status, (what, answer.status, answer.text[:300])
    assert piece in answer.text, (what, answer.text[:300])


def test_issue_cases_fail_alone(isolation_server: Launcher, neighbour_solo: list[int]) -> None:
    neighbours = Neighbours(isolation_server.url, neighbour_solo).start()
    slowest = 0.0
    for route, body, status, piece in ISSUE_CASES:
        answer = post(isolation_server.url, route, body)
        _check(answer, status, piece, (route, body[:80]))
        slowest = max(slowest, answer.elapsed_s)
    neighbours.stop()
    print(f"{len(ISSUE_CASES)} cases, slowest answer {slowest:.3f} s, {neighbours.runs} neighbour runs")
    wait_idle(isolation_server.url)


def test_refused_requests_do_not_fail_the_valid_ones_prefilled_with_them(isolation_server: Launcher) -> None:
    """Upstream-style batch (8 requests, the launcher's max_concurrent_requests): 6 valid ones (one
    with a grammar, one watermarked) arriving with two whose regex the shard cannot compile: those
    two fail alone."""
    valid = {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}
    bodies: list[bytes | dict[str, object]] = [valid] * 4 + [
        _generate('"grammar":{"type":"regex","value":"a+"}'), _generate('"watermark":true'),
        _generate('"grammar":{"type":"regex","value":"(unclosed"}'),
        _generate('"grammar":{"type":"regex","value":"[0-9"}')]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(isolation_server.url, "/generate", b), bodies))
    assert [a.status for a in answers] == [200] * 6 + [422, 422], [a.text for a in answers]
    assert all("regex grammar does not compile" in a.text for a in answers[6:]), [a.text for a in answers[6:]]


def _matrix_value_texts() -> list[tuple[str, str]]:
    """The probe values: (label, JSON text) -- NaN and Infinity are not JSON, sent raw."""
    return [("-1", "-1"), ("0", "0"), ("2^31", str(2**31)), ("2^32", str(2**32)), ("2^64", str(2**64)),
            ("NaN", "NaN"), ("Infinity", "Infinity"), ("string", '"20"')]


NUMERIC_FIELDS: dict[str, list[str]] = {
    "/generate": ["best_of", "temperature", "repetition_penalty", "frequency_penalty", "top_k", "top_p",
                  "typical_p", "max_new_tokens", "truncate", "seed", "top_n_tokens"],
    "/v1/chat/completions": ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                             "frequency_penalty", "presence_penalty", "top_logprobs", "n"],
    "/v1/completions": ["max_tokens", "temperature", "top_p", "seed", "repetition_penalty",
                        "frequency_penalty"],
}
# Where a field's 422 comes from validation, the message names the native field it maps to.
NAMED_AS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
            "presence_penalty": "repetition_penalty", "top_logprobs": "top_n_tokens"}


def _matrix_body(route: str, name: str, value: str) -> bytes:
    if route == "/generate":
        params = f'"{name}":{value}' if name == "max_new_tokens" else f'"max_new_tokens":2,"{name}":{value}'
        return b'{"inputs":"Hello","parameters":{' + params.encode() + b"}}"
    length = "" if name in ("max_tokens", "max_completion_tokens") else '"max_tokens":2,'
    extra = '"logprobs":true,' if name == "top_logprobs" else ""
    if route == "/v1/chat/completions":
        head = '{"messages":[{"role":"user","content":"Hi"}],'
    else:
        head = '{"prompt":"Hi",'
    return f'{head}{length}{extra}"{name}":{value}}}'.encode()


MATRIX = [(route, name, label, text) for route, names in NUMERIC_FIELDS.items() for name in names
          for label, text in _matrix_value_texts()]


def test_every_numeric_field_at_its_edges(isolation_server: Launcher, neighbour_solo: list[int]) -> None:
    """-1, 0, 2^31, 2^32, 2^64, NaN, Infinity and a string in every numeric field of every route:
    a 200, or a 4xx naming the field; never a 5xx or a hang; the neighbour keeps its tokens."""
    neighbours = Neighbours(isolation_server.url, neighbour_solo).start()

    def run(case: tuple[str, str, str, str]) -> tuple[tuple[str, str, str, str], Answer]:
        route, name, _, text = case
        return case, post(isolation_server.url, route, _matrix_body(route, name, text))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, MATRIX))
    neighbours.stop()
    statuses: dict[int, int] = {}
    for (route, name, label, _), answer in results:
        statuses[answer.status] = statuses.get(answer.status, 0) + 1
        assert answer.status in (200, 422), (route, name, label, answer.status, answer.text[:300])
        if answer.status == 422:
            assert name in answer.text or NAMED_AS.get(name, name) in answer.text, (route, name, label, answer.text)
        elif route == "/generate":
            assert json.loads(answer.text)["generated_text"] is not None
    print(f"{len(MATRIX)} cases: {statuses}; {neighbours.runs} neighbour runs, all with their solo tokens")
    wait_idle(isolation_server.url)
    assert_no_leaked_slots(isolation_server.url, MAX_CONCURRENT)


def test_a_partial_request_head_is_timed_out(isolation_server: Launcher) -> None:
    started = time.monotonic()
    with raw_connection(isolation_server.port) as conn:
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        assert conn.recv(1024) == b"", "the server answered a request it never received"
    elapsed = time.monotonic() - started
    assert elapsed < WATCHDOG_S
    print(f"partial head closed after {elapsed:.1f} s")


def _engine_request(prompt: str, max_new_tokens: int, **changes: object) -> ValidRequest:
    """A request as validation would build it, then changed the way a router bug or another
    router could: these values never pass our HTTP validation."""
    p = GenerateParameters(max_new_tokens=max_new_tokens)
    request = build_valid_request(prompt, p, (48, 8, max_new_tokens), ("", 0), True)
    chosen = {"seed": 0, **{k: v for k, v in changes.items() if k in ("seed", "top_k", "watermark", "temperature")}}
    chooser = dataclasses.replace(request.parameters, **chosen)  # type: ignore[arg-type]
    rest = {k: v for k, v in changes.items() if k in ("stop_sequences", "truncate", "adapter_id")}
    return dataclasses.replace(request, parameters=chooser, **rest)  # type: ignore[arg-type]


async def _engine_run(uds: str, plan: list[tuple[float, ValidRequest]]) -> list[list[InferEvent]]:
    """Our real batcher and shard client on the launcher's shard; requests join at the given delays."""
    client = await ShardClient.connect(uds)
    queue = Queue()
    serving = ServingLimits(48, 64, 256, 16000)
    shard = ShardInfo(requires_padding=True, dtype="torch.float32", device_type="cpu", speculate=0,
                      support_chunking=False, block_size=1, runner="", layer_skip_mode="off")
    batcher = Batcher(client, queue, shard, serving, build_metrics(48, 64), Health(), (1.2, 20, None),
                      first_batch_id=1 << 41)  # far from the launcher router's own batch ids
    task = asyncio.create_task(batcher.run())

    async def one(delay_s: float, request: ValidRequest) -> list[InferEvent]:
        await asyncio.sleep(delay_s)
        entry = queue.append(request)
        events: list[InferEvent] = []
        while not events or not (isinstance(events[-1], ErrorEvent) or (
                isinstance(events[-1], TokenEvent) and events[-1].end is not None)):
            events.append(await asyncio.wait_for(entry.events.get(), WATCHDOG_S))
        return events

    try:
        return list(await asyncio.gather(*(one(d, r) for d, r in plan)))
    finally:
        task.cancel()
        await client.close()


def test_the_batcher_fails_one_entry_alone(isolation_server: Launcher, neighbour_solo: list[int]) -> None:
    """Router-side encoding errors and shard refusals, in the neighbour's batch and in a batch
    admitted while it decodes: each bad entry gets its own 422 event, the neighbours their tokens."""
    neighbour = _engine_request("1, 2, 3, 4, 5,", NEIGHBOUR_TOKENS)
    bad = [
        _engine_request("Hello", 4, seed=2**64),  # protobuf: Value out of range
        _engine_request("Hello", 4, top_k=2**32),
        _engine_request("Hello", 4, stop_sequences=["\ud800"]),  # not encodable as UTF-8
        _engine_request("Hello", 4, adapter_id="\udfff"),
        _engine_request("Hello", 4, temperature=float("nan")),
    ]
    plan = [(0.0, neighbour), *((0.0, r) for r in bad), (0.5, neighbour), *((0.6, r) for r in bad)]
    results = asyncio.run(_engine_run(isolation_server.shard_socket, plan))
    for events in (results[0], results[len(bad) + 1]):
        ids = [e.token.id for e in events if isinstance(e, TokenEvent)]
        assert ids == neighbour_solo
    for events in results[1:len(bad) + 1] + results[len(bad) + 2:]:
        assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
        assert events[0].kind == "validation", events[0]


@pytest.mark.timeout(300)
def test_children_die_with_a_sigkilled_launcher() -> None:
    """Its own launcher, so that no test shares the one it kills."""
    launcher = start_launcher(ISOLATION_LIMITS, "sigkill")
    kids = children(launcher.proc.pid)
    try:
        assert len(kids) == 2, kids  # the shard and the router
        os.kill(launcher.proc.pid, signal.SIGKILL)
        launcher.proc.wait(WATCHDOG_S)
        deadline = time.monotonic() + WATCHDOG_S
        while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in kids if alive(pid)], "a child outlived its launcher"
    finally:
        launcher.stop()
        for pid in filter(alive, kids):
            os.kill(pid, signal.SIGKILL)
