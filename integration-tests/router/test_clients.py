"""The clients TGI and OpenAI users run, unmodified, against the launcher on the default model:
huggingface_hub's InferenceClient, openai, langchain-openai and litellm (pinned in
requirements-dev.txt). Each test names the client call it makes; a failure says which call broke.

The 135M model's words are not the point: the calls must work end to end (streams end cleanly,
tool calls parse, finish reasons and ids are OpenAI's), and grammars guarantee shapes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field
from router_launcher import Launcher
from test_guided_http import ASK, PERSON, WEATHER, WEATHER_ARGS

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class City(BaseModel):
    """A structured answer for the clients' parse / with_structured_output."""

    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


def _openai(server: Launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=300)


def _hub(server: Launcher) -> InferenceClient:
    return InferenceClient(base_url=server.url, timeout=300)


def _check_weather(name: str | None, arguments: str | dict[str, Any], call: str) -> None:
    assert name == "get_weather", (call, name)
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, WEATHER_ARGS)


# --- huggingface_hub -----------------------------------------------------------------------------

def test_hub_text_generation_whole_and_streamed(server: Launcher) -> None:
    hub = _hub(server)
    out = hub.text_generation("The capital of France is", max_new_tokens=6, details=True, return_full_text=False)
    assert out.details is not None and out.details.generated_tokens == 6, "InferenceClient.text_generation"
    pieces = list(hub.text_generation("The capital of France is", max_new_tokens=6, stream=True))
    assert "".join(pieces) == out.generated_text, "InferenceClient.text_generation(stream=True)"


def test_hub_chat_completion_whole_and_streamed(server: Launcher) -> None:
    """The stream crashed at its end (`data:[DONE]` without the space the client matches)."""
    hub = _hub(server)
    whole = hub.chat_completion(QUESTION, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content and whole.id.startswith("chatcmpl-"), "InferenceClient.chat_completion"
    chunks = list(hub.chat_completion(QUESTION, max_tokens=8, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content, "InferenceClient.chat_completion(stream=True)"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert len({c.id for c in chunks}) == 1, "one id for every chunk of a stream"


def test_hub_chat_completion_with_tools_and_grammar(server: Launcher) -> None:
    hub = _hub(server)
    out = hub.chat_completion(ASK, tools=[WEATHER], tool_choice="required", max_tokens=48, temperature=0)
    call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
    _check_weather(call.function.name, call.function.arguments, "InferenceClient.chat_completion(tools=...)")
    assert out.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
    stream = hub.chat_completion(ASK, tools=[WEATHER], tool_choice="required", max_tokens=48, temperature=0,
                                 stream=True)
    name, arguments, finish = None, "", None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            name = name or delta.function.name
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    _check_weather(name, arguments, "InferenceClient.chat_completion(tools=..., stream=True)")
    assert finish == "tool_calls"
    shaped = hub.chat_completion(QUESTION, max_tokens=48, temperature=0,
                                 response_format={"type": "json", "value": PERSON})
    jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), PERSON)


# --- openai ---------------------------------------------------------------------------------------

def test_openai_chat_ids_seed_and_logprobs(server: Launcher) -> None:
    client = _openai(server)
    first = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=8, temperature=0.7, seed=5)
    again = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=8, temperature=0.7, seed=5)
    assert first.choices[0].message.content == again.choices[0].message.content, "chat.completions.create(seed=5)"
    assert first.id != again.id and first.id.startswith("chatcmpl-") and first.created > 0
    assert first.usage is not None and first.usage.completion_tokens == 8
    scored = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = scored.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4 and all(len(t.top_logprobs) >= 2 for t in content), \
        "chat.completions.create(logprobs=True, top_logprobs=2)"


def test_openai_chat_second_turn_reports_cached_prompt_tokens(server: Launcher) -> None:
    """The shard's prefix cache (on by default) reuses the first turn; usage says how much."""
    client = _openai(server)
    history = [{"role": "system", "content": "You answer in one short sentence. " * 8}, *QUESTION]
    first = client.chat.completions.create(model="tgi", messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="tgi", messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    details = second.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert first.usage is not None and details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= first.usage.prompt_tokens - 4, (first.usage, second.usage)
    again = client.chat.completions.create(model="tgi", messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert again.choices[0].message.content == second.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # type: ignore[union-attr]


def test_openai_finish_reasons_and_refused_parameters(server: Launcher) -> None:
    client = _openai(server)
    greedy = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=24, temperature=0)
    words = (greedy.choices[0].message.content or "").split()
    assert len(words) >= 3, greedy
    stopped = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=24, temperature=0,
                                             stop=[words[2]])
    assert stopped.choices[0].finish_reason == "stop", "chat.completions.create(stop=...): OpenAI's value"
    for refused in ({"n": 2}, {"logit_bias": {"42": 5}}):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=4, **refused)  # type: ignore[call-overload]
        assert f"`{next(iter(refused))}` is not supported" in str(info.value.body), info.value.body


def test_openai_tools_auto_required_named_none_and_two_calls(server: Launcher) -> None:
    client = _openai(server)
    tools: Any = [WEATHER]
    ids = []
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(model="tgi", messages=ASK, tools=tools, tool_choice=choice,  # type: ignore[arg-type]
                                             max_tokens=48, temperature=0)
        call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
        _check_weather(call.function.name, call.function.arguments,  # type: ignore[union-attr]
                       f"chat.completions.create(tool_choice={choice})")
        assert out.choices[0].finish_reason == "tool_calls"
        ids.append(call.id)
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids), ids
    auto = client.chat.completions.create(model="tgi", messages=ASK, tools=tools, max_tokens=48, temperature=0)
    assert auto.choices[0].finish_reason == ("tool_calls" if auto.choices[0].message.tool_calls else "stop")
    none = client.chat.completions.create(model="tgi", messages=ASK, tools=tools, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    # The results go back with their calls' ids, and the conversation goes on.
    follow = client.chat.completions.create(model="tgi", max_tokens=8, temperature=0, messages=[
        *ASK, {"role": "assistant", "tool_calls": [{"id": ids[0], "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
        {"role": "tool", "tool_call_id": ids[0], "content": "18 degrees"}])  # type: ignore[list-item]
    assert follow.choices[0].message.content is not None, "chat.completions.create(tool result)"


def test_openai_stream_with_tool_deltas(server: Launcher) -> None:
    stream = _openai(server).chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
                                                     tool_choice="required", max_tokens=48, temperature=0,
                                                     stream=True)
    name, arguments, finish, call_ids, chunk_ids = None, "", None, set(), set()
    for chunk in stream:
        chunk_ids.add(chunk.id)
        for call in chunk.choices[0].delta.tool_calls or []:
            call_ids.add(call.id)
            name = name or (call.function.name if call.function else None)
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    _check_weather(name, arguments, "chat.completions.create(tools=..., stream=True)")
    assert finish == "tool_calls" and len(chunk_ids) == 1 and len(call_ids) == 1
    assert next(iter(call_ids)).startswith("call_")


def test_openai_parse_and_json_object(server: Launcher) -> None:
    client = _openai(server)
    parsed = client.chat.completions.parse(model="tgi", messages=QUESTION, max_tokens=48, temperature=0,
                                           response_format=City)
    assert isinstance(parsed.choices[0].message.parsed, City), "chat.completions.parse(response_format=City)"
    anything = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=32, temperature=0,
                                              response_format={"type": "json_object"})
    text = anything.choices[0].message.content or ""
    if anything.choices[0].finish_reason == "stop":  # a document cut by max_tokens is not whole
        assert isinstance(json.loads(text), dict), "chat.completions.create(response_format=json_object)"


def test_openai_completions_logprobs_and_stream(server: Launcher) -> None:
    client = _openai(server)
    out = client.completions.create(model="tgi", prompt="The capital of France is", max_tokens=5, temperature=0,
                                    logprobs=2)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and len(logprobs.tokens) == 5, "completions.create(logprobs=2)"
    assert logprobs.top_logprobs is not None and all(len(top) >= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == len("The capital of France is")
    assert out.id.startswith("cmpl-") and out.usage is not None and out.usage.completion_tokens == 5
    pieces = list(client.completions.create(model="tgi", prompt="The capital of France is", max_tokens=5,
                                            temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == out.choices[0].text, "completions.create(stream=True)"
    assert pieces[-1].choices[0].finish_reason == "length" and len({p.id for p in pieces}) == 1
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model="tgi", prompt="Hi", max_tokens=2, n=2)
    assert "`n` is not supported" in str(info.value.body), info.value.body


# --- langchain-openai -----------------------------------------------------------------------------

def test_langchain_openai_invoke_stream_tools_and_structured_output(server: Launcher) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server.url}/v1", api_key="-", model="tgi", temperature=0,  # type: ignore[arg-type]
                      max_completion_tokens=48, timeout=300)
    answer = chat.invoke("What is the capital of France?")
    assert isinstance(answer.content, str) and answer.content, "ChatOpenAI.invoke"
    streamed = "".join(str(chunk.content) for chunk in chat.stream("What is the capital of France?"))
    assert streamed == answer.content, "ChatOpenAI.stream"
    tooled = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK[0]["content"])
    assert tooled.tool_calls, "ChatOpenAI.bind_tools(...).invoke"  # type: ignore[attr-defined]
    call = tooled.tool_calls[0]  # type: ignore[attr-defined]
    _check_weather(call["name"], call["args"], "ChatOpenAI.bind_tools(...).invoke")
    city = chat.with_structured_output(City).invoke("Name a city and its country.")
    assert isinstance(city, City), "ChatOpenAI.with_structured_output(City).invoke"


# --- litellm --------------------------------------------------------------------------------------

def test_litellm_openai_and_huggingface_providers(server: Launcher) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: the packaged price list
    import litellm

    for model, base in (("openai/tgi", f"{server.url}/v1"), ("huggingface/tgi", f"{server.url}/v1")):
        out = litellm.completion(model=model, api_base=base, api_key="-", messages=QUESTION, max_tokens=8,
                                 temperature=0)
        assert out.choices[0].message.content, f"litellm.completion(model={model!r})"  # type: ignore[union-attr]
        chunks = list(litellm.completion(model=model, api_base=base, api_key="-", messages=QUESTION,
                                         max_tokens=8, temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)  # type: ignore[union-attr]
        assert text == out.choices[0].message.content, f"litellm.completion(model={model!r}, stream=True)"  # type: ignore[union-attr]


def test_openai_shapes_over_raw_http(server: Launcher) -> None:
    """What the clients above rely on, byte for byte: the SSE framing and [DONE]."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=300, json={
            "messages": QUESTION, "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-1]
    assert all(line.startswith("data: {") for line in lines[:-1]), lines
