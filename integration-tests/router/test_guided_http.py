"""Guided generation end to end, with the real clients: `response_format`, tools and `grammar`.

The grammar guarantees the shape, not the content: each answer of the 135M model must parse
and validate (jsonschema) against its schema. Schemas bound their strings, numbers and arrays
so that a document always ends within max_tokens.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
from huggingface_hub import InferenceClient
from router_launcher import Launcher
from text_generation import Client
from text_generation.types import Grammar, GrammarType

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = [
    "Invent a person.", "Describe a retired teacher.", "Who is your best friend?", "Tell me about a chef in Paris.",
    "A young footballer from Lima.", "Describe your grandmother.", "A famous painter.", "My neighbour is a pilot.",
    "Describe a student who likes chess.", "An astronaut from Tokyo.", "Write about a baker.",
    "A musician who plays the violin.", "Describe a doctor.", "A child who loves dinosaurs.",
    "Tell me about a writer from London.", "An old fisherman.", "Describe a software engineer.",
    "A gardener with many hobbies.", "Describe a marathon runner.", "Who was Ada Lovelace?",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {"name": "set_alarm", "description": "Set an alarm",
                 "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                                          "maximum": 23}}, "required": ["hour"]}},
}
WEATHER_ARGS = {**WEATHER["function"]["parameters"], "additionalProperties": False}  # type: ignore[dict-item]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _openai(server: Launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=300)


def test_openai_json_schema_on_twenty_prompts(server: Launcher) -> None:
    client = _openai(server)
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(prompt: str) -> str:
        out = client.chat.completions.create(model="tgi", messages=[{"role": "user", "content": prompt}],
                                             response_format=response_format, max_tokens=48, temperature=0)
        assert out.choices[0].finish_reason == "stop", out
        return out.choices[0].message.content or ""

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch: the router batches them together
        answers = list(pool.map(ask, PROMPTS))
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        jsonschema.validate(json.loads(answer), PERSON), (prompt, answer)
    print(f"{len(answers)} answers, e.g. {answers[0]}")


def test_response_format_in_tgis_shape_and_json_object(server: Launcher) -> None:
    client = _openai(server)
    tgi_shape: Any = {"type": "json", "value": PERSON}
    out = client.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "A person."}],
                                         response_format=tgi_shape, max_tokens=48, temperature=0)
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), PERSON)
    json_mode = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Give me a JSON object."}], "max_tokens": 24, "temperature": 0,
        "response_format": {"type": "json_object"}}).json()
    assert json_mode["choices"][0]["message"]["content"].startswith("{")


def _check_call(name: str | None, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_ARGS)


def test_openai_tool_call_whole_and_streamed(server: Launcher) -> None:
    client = _openai(server)
    tools: Any = [WEATHER, ALARM]  # a named choice puts that tool alone in the prompt and the grammar
    out = client.chat.completions.create(model="tgi", messages=ASK, tools=tools, max_tokens=48, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = out.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1 and out.choices[0].message.content is None
    _check_call(calls[0].function.name, calls[0].function.arguments)  # type: ignore[union-attr]
    stream = client.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER], max_tokens=48,  # type: ignore[list-item]
                                            temperature=0, tool_choice="required", stream=True)
    name, arguments, finish = None, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or []:
            name = name or (call.function.name if call.function else None)
            arguments += call.function.arguments or "" if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    _check_call(name, arguments)
    assert finish == "tool_calls"  # OpenAI's value for a tool answer (upstream says "stop")


def test_tool_choice_none_auto_and_exclusive_formats(server: Launcher) -> None:
    client = _openai(server)
    tools: Any = [WEATHER]
    plain = client.chat.completions.create(model="tgi", messages=ASK, tools=tools, tool_choice="none",
                                           max_tokens=12, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    auto = client.chat.completions.create(model="tgi", messages=ASK, tools=tools, max_tokens=48, temperature=0)
    message = auto.choices[0].message
    if message.tool_calls:  # the model may call the tool or decline (no_tool: plain text)
        _check_call(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)  # type: ignore[union-attr]
    else:
        assert message.content is not None
    both = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": ASK, "tools": [WEATHER], "response_format": {"type": "json", "value": PERSON}})
    assert both.status_code == 422
    assert both.json() == {"error": "Tool error: Grammar and tools are mutually exclusive", "error_type": "tool_error"}
    unknown = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": "launch_rocket"})
    assert unknown.status_code == 422 and "Tool with name launch_rocket not found" in unknown.json()["error"]


def test_grammar_with_inference_client_and_text_generation_client(server: Launcher) -> None:
    regex = r"(yes|no), [0-9]{2} percent"
    hub = InferenceClient(base_url=server.url, timeout=300)
    # POST / returns the prompt too by default (unknown pipeline tag), as upstream's.
    text = hub.text_generation("Is it raining?", max_new_tokens=16, grammar={"type": "regex", "value": regex},
                               return_full_text=False)
    assert re.fullmatch(regex, text), text
    text = hub.text_generation("A person:", max_new_tokens=48, grammar={"type": "json", "value": PERSON},
                               return_full_text=False)
    jsonschema.validate(json.loads(text), PERSON)
    tg = Client(server.url, timeout=300)
    out = tg.generate("Is it sunny?", max_new_tokens=16, grammar=Grammar(type=GrammarType.Regex, value=regex),
                      return_full_text=False)
    assert re.fullmatch(regex, out.generated_text), out.generated_text
    out = tg.generate("A person:", max_new_tokens=48, grammar=Grammar(type=GrammarType.Json, value=PERSON),
                      return_full_text=False)
    jsonschema.validate(json.loads(out.generated_text), PERSON)


def test_grammar_refusals_and_watermark_over_http(server: Launcher) -> None:
    def generate(parameters: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/generate", timeout=60,
                          json={"inputs": "Hi", "parameters": {"max_new_tokens": 3, **parameters}})

    bad_schema = generate({"grammar": {"type": "json", "value": {"properties": {"a": {"type": "nonsense"}}}}})
    assert bad_schema.status_code == 422 and bad_schema.json()["error"].startswith(
        "Input validation error: grammar is not valid: "), bad_schema.text
    no_props = generate({"grammar": {"type": "json", "value": {"type": "object"}}})
    assert no_props.json()["error"] == (
        "Input validation error: grammar is not valid: Grammar must have a 'properties' field")
    bad_regex = generate({"grammar": {"type": "regex", "value": "(unclosed"}})  # compiled (and refused) by the shard
    assert bad_regex.status_code == 422 and "regex grammar does not compile" in bad_regex.json()["error"]
    assert generate({"watermark": True}).status_code == 200
