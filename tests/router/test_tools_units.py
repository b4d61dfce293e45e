"""Tools without a model: tool_choice parsing, the tool grammar, and streamed argument fragments."""

from __future__ import annotations

import json

import jsonschema
import pytest

from text_generation_router.engine.schemas import Tool
from text_generation_router.http.tools import (
    NO_TOOL,
    ToolCallStream,
    ToolChoice,
    ToolFailed,
    parse_tool_output,
    tool_schema,
    tools_to_use,
)

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
ALARM = Tool.model_validate({"function": {"name": "set_alarm", "arguments": {
    "type": "object", "properties": {"hour": {"type": "integer"}}}}})


def test_tool_choice_forms() -> None:
    assert ToolChoice.parse(None) == ToolChoice("auto") == ToolChoice.parse("auto")
    assert ToolChoice.parse("none").kind == "none" and ToolChoice.parse("required").kind == "required"
    assert ToolChoice.parse("set_alarm") == ToolChoice("function", "set_alarm")
    assert ToolChoice.parse({"type": "function", "function": {"name": "x"}}) == ToolChoice("function", "x")
    with pytest.raises(ToolFailed, match=r'^Tool error: tool_choice \{"type": "nope"\} is not'):
        ToolChoice.parse({"type": "nope"})
    assert [t.function.name for t in tools_to_use([WEATHER, ALARM], ToolChoice("auto"))] == [
        "get_weather", "set_alarm", NO_TOOL]
    assert tools_to_use([WEATHER, ALARM], ToolChoice("none")) == []
    assert tools_to_use([WEATHER, ALARM], ToolChoice("function", "set_alarm")) == [ALARM]
    with pytest.raises(ToolFailed, match="^Tool error: Tool with name launch not found$"):
        tools_to_use([WEATHER], ToolChoice("function", "launch"))


def test_tool_schema_accepts_calls_and_refuses_others() -> None:
    schema = tool_schema(tools_to_use([WEATHER, ALARM], ToolChoice("auto")))
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"function": {"_name": "get_weather", "city": "Paris"}})
    assert validator.is_valid({"function": {"_name": NO_TOOL}})
    assert not validator.is_valid({"function": {"_name": "get_weather"}})  # city is required
    assert not validator.is_valid({"function": {"_name": "other", "city": "Paris"}})
    assert not validator.is_valid({})


def test_parse_tool_output() -> None:
    assert parse_tool_output('{"function": {"_name": "get_weather", "city": "Paris"}}') == (
        "get_weather", {"city": "Paris"})
    assert parse_tool_output('{"function": {"_name": "no_tool"}}') is None
    with pytest.raises(ToolFailed, match="^Tool error: Failed to parse generated text"):
        parse_tool_output('{"function": ')


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_fragments_join_into_the_arguments(size: int) -> None:
    document = '{"function": {"_name": "get_weather", "city": "Paris {x}", "days": [1, {"a": 2}]}}'
    stream, name, arguments = ToolCallStream(), None, ""
    for start in range(0, len(document), size):
        fragments = stream.push(document[start:start + size])
        assert fragments is not None
        for fragment_name, text in fragments:
            name = name or fragment_name
            arguments += text
    assert name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris {x}", "days": [1, {"a": 2}]}


def test_streamed_no_tool_is_declined() -> None:
    stream = ToolCallStream()
    assert stream.push('{"function": {"_name": "no') == []
    assert stream.push('_tool"') is None
