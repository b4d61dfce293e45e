"""The router's own OpenAPI document: valid, and fuzzed with schemathesis against a real launcher.

Bounded: a fixed number of derandomized examples per operation (positive and negative), every
generation that validation would accept capped at a few tokens, and a time cap per operation.
Zero 5xx, zero hangs (the watchdog timeout of every call), and an innocent greedy neighbour
decoding the whole time keeps its solo tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from isolation_harness import WATCHDOG_S, Neighbours, wait_idle
from router_launcher import Launcher
from schemathesis import GenerationMode

EXAMPLES_PER_OPERATION = 10
CAPPED_NEW_TOKENS = 4


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_openapi_document_is_valid(isolation_server: Launcher) -> None:
    doc = httpx.get(f"{isolation_server.url}/api-doc/openapi.json", timeout=WATCHDOG_S).json()
    schemathesis.openapi.from_dict(doc).validate()  # against the OpenAPI 3.1 meta-schema
    schemas = doc["components"]["schemas"]
    dangling = [r for r in _refs(doc) if r.removeprefix("#/components/schemas/") not in schemas]
    assert not dangling, dangling
    paths = doc["paths"]
    assert "text/event-stream" in paths["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    for route in ("/generate", "/v1/chat/completions", "/v1/completions"):
        operation = paths[route]["post"]
        assert operation["requestBody"]["required"] is True
        assert {"400", "413", "415", "422", "424", "429"} <= set(operation["responses"])
    assert schemas["ChatRequest"]["required"] == ["messages"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["GenerateRequest"]["required"] == ["inputs"]
    seed = schemas["GenerateParameters"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (0, 2**64 - 1)


@pytest.fixture(scope="module")
def api_schema(isolation_server: Launcher) -> Any:
    return schemathesis.openapi.from_url(f"{isolation_server.url}/api-doc/openapi.json")


@pytest.fixture(scope="module")
def fuzz_neighbours(isolation_server: Launcher, neighbour_solo: list[int]) -> Neighbours:
    return Neighbours(isolation_server.url, neighbour_solo).start()


def _capped(value: Any) -> Any:
    """A length that validation would accept becomes a short one; refused ones stay as they are."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and CAPPED_NEW_TOKENS < value <= 64):
        return CAPPED_NEW_TOKENS
    return value


def _bound(case: Any) -> None:
    """Keep every generation to a few tokens (the 64-token limit and validation refuse the rest)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path in ("/generate", "/generate_stream", "/", "/tokenize"):
        if body.get("parameters") is None:
            body["parameters"] = {}
        if isinstance(body["parameters"], dict):
            body["parameters"]["max_new_tokens"] = _capped(body["parameters"].get("max_new_tokens"))
    elif body.get("max_completion_tokens") is None:
        body["max_tokens"] = _capped(body.get("max_tokens"))
    else:
        body["max_completion_tokens"] = _capped(body["max_completion_tokens"])


GET_OPERATIONS = ["/", "/health", "/ping", "/info", "/metrics", "/v1/models"]
POST_OPERATIONS = ["/generate", "/generate_stream", "/", "/tokenize", "/v1/chat/completions", "/v1/completions",
                   "/chat_tokenize"]
# Documented but not fuzzed, and why.
NOT_FUZZED = {
    "/vertex": "upstream answers 500 `Incomplete generation` for any failed instance, by design",
    "/invocations": "its bodies are those of /, /v1/chat/completions and /v1/completions, fuzzed there, and it "
                    "answers as they do (tests/router/test_conformance_http.py)",
}


def test_every_documented_operation_is_fuzzed(api_schema: Any) -> None:
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    fuzzed = {("GET", p) for p in GET_OPERATIONS} | {("POST", p) for p in POST_OPERATIONS}
    assert documented == fuzzed | {("POST", p) for p in NOT_FUZZED}


def _fuzz(api_schema: Any, method: str, path: str, mode: GenerationMode) -> dict[int, int]:
    """Run the bounded examples of one operation; returns how many answers had each status."""
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(api_schema[path][method].as_strategy(mode))
    def run(case: Any) -> None:
        _bound(case)
        response = case.call(timeout=WATCHDOG_S)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.status_code,
                                            response.text[:300])

    run()
    return statuses


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("method", "path", "mode"), [
    *(("GET", p, GenerationMode.POSITIVE) for p in GET_OPERATIONS),
    *(("POST", p, m) for p in POST_OPERATIONS for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)),
])
def test_fuzz_no_server_errors(api_schema: Any, fuzz_neighbours: Neighbours, method: str, path: str,
                               mode: GenerationMode) -> None:
    statuses = _fuzz(api_schema, method, path, mode)
    print(f"{method} {path} {mode}: {statuses}")


def test_fuzz_neighbours_kept_their_tokens(isolation_server: Launcher, fuzz_neighbours: Neighbours) -> None:
    fuzz_neighbours.stop()
    print(f"{fuzz_neighbours.runs} neighbour runs during the fuzz, all with their solo tokens")
    wait_idle(isolation_server.url)
