"""Upstream conformance items end to end, on the session's launcher (tests/router/conftest.py):
/chat_tokenize, /invocations, /vertex, the request's model echoed, a trailing assistant message
continued, and --prometheus-port serving the metrics."""

from __future__ import annotations

import httpx
from router_launcher import Launcher
from transformers import AutoTokenizer

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights

ASK = [{"role": "user", "content": "Name a colour."}]


def test_chat_tokenize_and_continue_final_message(server: Launcher) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(download_weights(DEFAULT_MODEL_ID)))
    out = httpx.post(f"{server.url}/chat_tokenize", json={"messages": ASK}, timeout=60).json()
    expected = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert out["templated_text"] == expected
    tokens = out["tokenize_response"]
    assert [t["id"] for t in tokens] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert "".join(t["text"] for t in tokens) == expected
    assert all(expected[t["start"]:t["stop"]] == t["text"] for t in tokens)
    # A trailing assistant message is continued: the prompt ends with its text, no new turn.
    partial = [*ASK, {"role": "assistant", "content": "My favourite colour is"}]
    out = httpx.post(f"{server.url}/chat_tokenize", json={"messages": partial}, timeout=60).json()
    assert out["templated_text"].endswith("<|im_start|>assistant\nMy favourite colour is"), out["templated_text"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": partial, "max_tokens": 4, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"]


def test_response_model_echoes_the_request(server: Launcher) -> None:
    body = {"messages": ASK, "max_tokens": 2, "temperature": 0}
    named = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "model": "my-model"}, timeout=120)
    assert named.status_code == 200 and named.json()["model"] == "my-model", named.text
    for model in ("tgi", None):
        out = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "model": model}, timeout=120).json()
        assert out["model"] == DEFAULT_MODEL_ID
    completion = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": "Hello", "max_tokens": 2, "temperature": 0, "model": DEFAULT_MODEL_ID}).json()
    assert completion["model"] == DEFAULT_MODEL_ID


def test_invocations_takes_each_body_kind(server: Launcher) -> None:
    generate = httpx.post(f"{server.url}/invocations", timeout=120, json={
        "inputs": "Hello", "parameters": {"max_new_tokens": 3, "do_sample": False}})
    assert generate.status_code == 200, generate.text
    direct = httpx.post(f"{server.url}/", timeout=120, json={
        "inputs": "Hello", "parameters": {"max_new_tokens": 3, "do_sample": False}}).json()
    assert generate.json() == direct  # a list with the prompt in front, as POST /
    chat = httpx.post(f"{server.url}/invocations", timeout=120, json={"messages": ASK, "max_tokens": 3}).json()
    assert chat["object"] == "chat.completion"
    completion = httpx.post(f"{server.url}/invocations", timeout=120, json={"prompt": "Hi", "max_tokens": 3}).json()
    assert completion["object"] == "text_completion"
    bad = httpx.post(f"{server.url}/invocations", timeout=60, json={"nothing": 1})
    assert bad.status_code == 422 and "did not match any variant of untagged enum SagemakerRequest" in bad.text


def test_vertex_predictions(server: Launcher) -> None:
    out = httpx.post(f"{server.url}/vertex", timeout=120, json={"instances": [
        {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "seed": 1}},
        {"messages": ASK, "max_tokens": 3, "temperature": 0}]})
    assert out.status_code == 200, out.text
    predictions = out.json()["predictions"]
    assert len(predictions) == 2 and all(isinstance(p, str) and p for p in predictions)


def test_prometheus_port_serves_the_metrics(server: Launcher) -> None:
    httpx.post(f"{server.url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, timeout=60)
    text = httpx.get(f"http://127.0.0.1:{server.prometheus_port}/metrics", timeout=10).text
    assert "tgi_request_duration_count" in text and "tgi_batch_next_size_bucket{le=\"3.0\"}" in text
