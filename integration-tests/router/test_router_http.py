"""End to end: a real `text-generation-launcher` on the default model, driven by real clients.

One launcher (the session's `server`, tests/router/conftest.py) serves these tests. Greedy
outputs are checked against the shard itself, driven over gRPC on the launcher's own socket.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from router_launcher import Launcher
from router_shard_direct import DIRECT_ID_BASE, greedy_tokens
from text_generation import Client

PROMPT = "def fibonacci(n):"
PROMPTS = [PROMPT, "The three primary colors are", "import numpy as np\n", "Once upon a time,"]
MAX_NEW = 8


def sse_events(response: httpx.Response) -> Iterator[str]:
    """Payloads of `data: ` lines, checking the framing byte for byte (one space after the colon)."""
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: ") and not line.startswith("data:  "), line
            yield line[len("data: "):]


def stream_text(url: str, prompt: str, max_new: int = MAX_NEW) -> str:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as r:
        events = [json.loads(e) for e in sse_events(r)]
    assert events[-1]["generated_text"] is not None, events[-1]
    return "".join(e["token"]["text"] for e in events)


def test_text_generation_client_matches_shard_greedy(server: Launcher) -> None:
    client = Client(server.url, timeout=120)
    response = client.generate(PROMPT, max_new_tokens=MAX_NEW, decoder_input_details=True)
    details = response.details
    assert details.generated_tokens == MAX_NEW
    assert details.finish_reason.value == "length"
    assert details.prefill[0].logprob is None and len(details.prefill) > 1
    expected = greedy_tokens(server.shard_socket, PROMPT, MAX_NEW)
    assert [t.id for t in details.tokens] == expected
    # return_full_text defaults to true on POST / (unknown pipeline tag).
    raw = httpx.post(server.url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert raw.json()[0]["generated_text"].startswith(PROMPT)


def test_text_generation_client_stream_with_details(server: Launcher) -> None:
    client = Client(server.url, timeout=120)
    responses = list(client.generate_stream(PROMPT, max_new_tokens=MAX_NEW))
    assert [r.token.id for r in responses] == greedy_tokens(
        server.shard_socket, PROMPT, MAX_NEW, DIRECT_ID_BASE + 1)
    assert all(r.generated_text is None for r in responses[:-1])
    last = responses[-1]
    assert last.details is not None and last.details.generated_tokens == MAX_NEW
    assert last.generated_text == "".join(r.token.text for r in responses)


def test_inference_client_text_generation_and_chat(server: Launcher) -> None:
    client = InferenceClient(base_url=server.url)
    out = client.text_generation(PROMPT, max_new_tokens=MAX_NEW, details=True)
    assert out.details is not None and out.details.generated_tokens == MAX_NEW
    assert [t.id for t in out.details.tokens] == greedy_tokens(
        server.shard_socket, PROMPT, MAX_NEW, DIRECT_ID_BASE + 2)
    chat = client.chat_completion(
        [{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
        temperature=0,
    )
    assert "Paris" in (chat.choices[0].message.content or "")
    assert chat.usage.completion_tokens <= 12


def test_openai_chat_stream_equals_non_stream(server: Launcher) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    messages: Any = [{"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model="tgi", messages=messages, max_tokens=MAX_NEW,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model="tgi", messages=messages,
                                                 max_tokens=MAX_NEW, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.total_tokens > full.usage.prompt_tokens


def test_sixteen_concurrent_streams_match_their_solo_runs(server: Launcher) -> None:
    alone = {p: stream_text(server.url, p) for p in PROMPTS}
    prompts = PROMPTS * 4
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda p: stream_text(server.url, p), prompts))
    assert texts == [alone[p] for p in prompts]


def test_client_disconnect_does_not_disturb_others(server: Launcher) -> None:
    expected = stream_text(server.url, PROMPTS[1], 16)
    results: list[str] = []
    started = threading.Barrier(3)

    def survivor() -> None:
        started.wait()
        results.append(stream_text(server.url, PROMPTS[1], 16))

    threads = [threading.Thread(target=survivor) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 200}}
    with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=120) as r:
        for n, _ in enumerate(sse_events(r)):
            if n == 2:
                break  # leaving the block closes the connection mid-stream
    for t in threads:
        t.join()
    assert results == [expected, expected]
    # The server keeps serving after the drop.
    assert stream_text(server.url, PROMPTS[2], 4)


@pytest.mark.parametrize(("parameters", "message"), [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 3}, "`seed` must not be set when `best_of` > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"top_n_tokens": 9}, "`top_n_tokens` must be >= 0 and <= 5. Given: 9"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 256. Given: 0"),
    ({"max_new_tokens": 510},
     ("`inputs` tokens + `max_new_tokens` must be <= 512. Given: 6 `inputs` tokens and 510 "
     "`max_new_tokens`")),
    ({"layer_skip": "fast"},
     "`layer_skip` must be one of off, shadow, lossy, verified. Given: fast"),
    ({"grammar": {"type": "json", "value": {"type": "object"}}},
     "grammar is not valid: Grammar must have a 'properties' field"),
])
def test_validation_messages_over_http(server: Launcher, parameters: dict[str, object], message: str) -> None:
    r = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=60)
    assert r.status_code == 422
    assert r.json() == {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_validation_of_inputs_and_streams_over_http(server: Launcher) -> None:
    def error(path: str, body: Mapping[str, object]) -> str:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        if path == "/generate_stream":
            assert r.status_code == 200
            payload = json.loads(r.text.removeprefix("data:"))
        else:
            assert r.status_code == 422
            payload = r.json()
        assert payload["error_type"] == "validation"
        return str(payload["error"]).removeprefix("Input validation error: ")

    assert error("/generate", {"inputs": ""}) == "`inputs` cannot be empty"
    long_prompt = "hello " * 300
    # /tokenize refuses it too (its own input limit), with the count in upstream's message.
    tokenized = httpx.post(f"{server.url}/tokenize", json={"inputs": long_prompt}, timeout=60)
    assert tokenized.status_code == 422
    num_tokens = int(tokenized.json()["error"].rsplit("Given: ", 1)[1])
    assert error("/generate", {"inputs": long_prompt, "parameters": {"max_new_tokens": 1}}) == (
        f"`inputs` must have less than 256 tokens. Given: {num_tokens}"
    )
    stream = {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}}
    assert error("/generate_stream", stream) == "`best_of` != 1 is not supported when streaming tokens"
    stream = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
    assert error("/generate_stream", stream) == (
        "`decoder_input_details` == true is not supported when streaming tokens"
    )


def test_malformed_bodies_get_upstream_status_codes(server: Launcher) -> None:
    url = f"{server.url}/generate"
    headers = {"content-type": "application/json"}
    assert httpx.post(url, content=b'{"inputs":', headers=headers).status_code == 400
    assert httpx.post(url, content=b'{"parameters":{}}', headers=headers).status_code == 422
    assert httpx.post(url, content=b'{"inputs": 3}', headers=headers).status_code == 422
    assert httpx.post(url, content=b'{"inputs":"x"}', headers={"content-type": "text/plain"}).status_code == 415
    big = json.dumps({"inputs": "a" * 2_100_000}).encode()
    assert httpx.post(url, content=big, headers=headers).status_code == 413


def metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_move_with_traffic(server: Launcher) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}},
               timeout=60).raise_for_status()
    httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {"top_k": 0}})
    after = httpx.get(f"{server.url}/metrics").text
    for series, delta in [
        ("tgi_request_count", 2), ("tgi_request_success", 1),
        ('tgi_request_failure{err="validation"}', 1),
        ('tgi_batch_inference_count{method="prefill"}', 1),
        ('tgi_batch_inference_count{method="decode"}', 2),
        ("tgi_request_duration_count", 1), ("tgi_request_generated_tokens_sum", 3),
    ]:
        assert metric(after, series) - metric(before, series) >= delta, series
    assert "# TYPE tgi_request_count counter" in after
    assert metric(after, "tgi_batch_max_total_tokens") == 16000
    # The shard's memory by part (extension): set at warm-up, its serving parts after every step.
    memory = {part: metric(after, f'tgi_shard_memory_bytes{{part="{part}"}}')
              for part in ("embeddings", "layers", "kv", "prefix_cache", "resident", "peak", "other")}
    assert memory["layers"] > 100 * 2**20 and memory["embeddings"] > 10 * 2**20, memory
    assert memory["peak"] >= memory["resident"] > memory["layers"] + memory["embeddings"], memory


def test_kv_blocks_are_counted_per_request_and_come_back(server: Launcher) -> None:
    """The router counts the paged shard's KV blocks (upstream v3's allocator): a request holds
    them while it runs; a prefilled prompt's full blocks stay cached for the next one."""
    long_prompt = "Count the apples, pears and plums in each basket, then add them up. " * 12
    for _ in range(2):
        httpx.post(f"{server.url}/generate", json={"inputs": long_prompt, "parameters": {"max_new_tokens": 2}},
                   timeout=60).raise_for_status()
    text = httpx.get(f"{server.url}/metrics").text
    blocks = {state: metric(text, f'tgi_kv_blocks{{state="{state}"}}') for state in ("used", "cached", "free")}
    assert blocks["used"] == 0 and blocks["cached"] >= 2, blocks
    assert sum(blocks.values()) == 16000 // 64, blocks  # max-batch-total-tokens in blocks (block 0 apart)


def test_info_routes_tokenize_and_completions(server: Launcher) -> None:
    info = httpx.get(f"{server.url}/info").json()
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (256, 512)
    assert info["router"] == "text-generation-router"
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["object"] == "model"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/").status_code == 200
    assert httpx.get(f"{server.url}/docs").status_code == 200
    assert "/generate" in httpx.get(f"{server.url}/api-doc/openapi.json").json()["paths"]
    spans = httpx.post(f"{server.url}/tokenize", json={"inputs": "hello world"}).json()
    assert "".join(s["text"] for s in spans) == "hello world"
    r = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "layer_skip": "off"}}, timeout=60)
    assert r.status_code == 200 and r.headers["x-generated-tokens"] == "4"
    assert {"x-compute-time", "x-queue-time", "x-prompt-tokens"} <= set(r.headers)
    assert "x-layer-skip-mode" not in r.headers
    body = {"model": "tgi", "prompt": [PROMPT, PROMPTS[1]], "max_tokens": 4, "temperature": 0}
    done = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in done["choices"]] == [0, 1]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        payloads = list(sse_events(r))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    first = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == 0)
    assert first == done["choices"][0]["text"]


def test_layer_skip_shadow_report_in_details_and_headers(server: Launcher) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "layer_skip": "shadow",
                                             "details": True}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    report = r.json()["details"]["layer_skip"]
    assert report["mode"] == "shadow"
    assert set(report) == {"mode", "skipped_layers", "rule", "max_score", "mean_score", "stats"}
    assert r.headers["x-layer-skip-mode"] == "shadow"
    assert r.headers["x-layers-skipped"] == str(len(report["skipped_layers"]))
    # Shadow mode skips nothing: the tokens equal the shard's plain greedy run.
    ids = [t["id"] for t in r.json()["details"]["tokens"]]
    assert ids == greedy_tokens(server.shard_socket, PROMPT, 4, DIRECT_ID_BASE + 3)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'tgi_layer_skip_plans{{mode="shadow",rule="{report["rule"]}"}}' in metrics
    assert 'tgi_layer_skip_policy_loaded{mode="off",state="none"} 1.0' in metrics
    assert "tgi_layer_skip_decision_duration_count" in metrics
