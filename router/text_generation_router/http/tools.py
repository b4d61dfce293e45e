"""Tools (function calling) as upstream does them: a JSON grammar over the functions, the tools in
the prompt, and the answer parsed back into `tool_calls`, whole or streamed.

Design note. The model is made to write one JSON document
`{"function": {"_name": <tool name>, <argument>: <value>, ...}}`: the grammar is a JSON schema
whose `function` is any of the tools' schemas, each with a `_name` constant and the tool's
parameters. With tool_choice `auto` upstream's extra `no_tool` function ("Open ended response
with no specific tool selected") lets the model decline; when it does, the request is answered
again without tools, as plain text. `required` offers every tool, a named choice that tool
only, `none` no grammar at all. Unlike upstream's schema, `function` and `_name` are required
here (upstream's leaves them optional, so `{}` would be a valid answer that cannot be parsed).

Streaming: the text is buffered until the tool's name is known, then the arguments are sent as
`tool_calls[0].function.arguments` fragments whose concatenation is the arguments object (the
`_name` entry and the document's outer `}` are left out), the shape the `openai` client joins.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from text_generation_router.engine.errors import InferError
from text_generation_router.engine.schemas import FunctionDefinition, Tool

NO_TOOL = "no_tool"
DEFAULT_TOOL_PROMPT = (
    "\nGiven the functions available, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt. Respond in the format {name: function name, "
    "parameters: dictionary of argument name and its value}.Do not use variables.\n"
)
_NO_TOOL = Tool(type="function", function=FunctionDefinition(
    name=NO_TOOL, description="Open ended response with no specific tool selected", arguments={"type": "object"}))
# The document's head up to the end of the tool's name.
_HEAD = re.compile(r'\s*\{\s*"function"\s*:\s*\{\s*"_name"\s*:\s*"((?:[^"\\]|\\.)*)"')


class ToolFailed(InferError):
    status = 422
    error_type = "tool_error"
    metric_label = "validation"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Tool error: {detail}")


@dataclass(frozen=True)
class ToolChoice:
    """tool_choice: `auto` (the default), `none`, `required`, or one function by name."""

    kind: Literal["auto", "none", "required", "function"]
    name: str = ""

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> ToolChoice:
        """Upstream's reading: null or "auto", "none", "required", any other string names a
        function, as does `{"type": "function", "function": {"name": ...}}`."""
        if value is None or value == "auto":
            return cls("auto")
        if value in ("none", "required"):
            return cls(value)  # type: ignore[arg-type]
        if isinstance(value, str):
            return cls("function", value)
        function = value.get("function")
        if value.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                function.get("name"), str):
            raise ToolFailed(f"tool_choice {json.dumps(value)} is not \"auto\", \"none\", \"required\", a "
                             "function name or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return cls("function", function["name"])


def tools_to_use(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools the grammar offers (empty: no grammar)."""
    if choice.kind == "none":
        return []
    if choice.kind == "function":
        chosen = [t for t in tools if t.function.name == choice.name]
        if not chosen:
            raise ToolFailed(f"Tool with name {choice.name} not found")
        return chosen[:1]
    return [*tools, _NO_TOOL] if choice.kind == "auto" else list(tools)


def tool_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON schema of `{"function": {"_name": ..., arguments...}}` over `tools`."""
    functions: dict[str, Any] = {}
    for tool in tools:
        f = tool.function
        arguments = f.arguments if isinstance(f.arguments, dict) else {}
        properties = {"_name": {"type": "string", "const": f.name}, **arguments.get("properties", {})}
        required = ["_name", *[r for r in arguments.get("required", []) if isinstance(r, str)]]
        functions[f.name] = {"type": "object", "description": f.description or "", "properties": properties,
                             "required": required, "additionalProperties": False}
    return {
        "type": "object",
        "$functions": functions,
        "properties": {"function": {"anyOf": [{"$ref": f"#/$functions/{t.function.name}"} for t in tools]}},
        "required": ["function"],
        "additionalProperties": False,
    }


def tools_json(tools: list[Tool]) -> str:
    """The tools as upstream writes them into the prompt (each function's schema as a string)."""
    return json.dumps([{"type": t.type, "function": {
        "description": t.function.description, "name": t.function.name,
        "arguments": json.dumps(t.function.arguments, separators=(",", ":"))}} for t in tools],
        separators=(",", ":"), ensure_ascii=False)


def add_tools_to_prompt(messages: list[dict[str, Any]], tools: list[Tool], tool_prompt: str | None,
                        template_uses_tools: bool) -> None:
    """Append the tool prompt (and, when the template does not render `tools`, the tools
    themselves) to the last message, as upstream does."""
    prompt = tool_prompt or DEFAULT_TOOL_PROMPT
    text = f"\n---\n{prompt}" if template_uses_tools else f"\n---\n{tools_json(tools)}\n{prompt}"
    if messages and messages[-1].get("tool_calls") is None:
        messages[-1]["content"] = str(messages[-1].get("content") or "") + text


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools in the OpenAI shape chat templates read."""
    return [{"type": t.type, "function": {"name": t.function.name, "description": t.function.description,
                                          "parameters": t.function.arguments or {}}} for t in tools]


def parse_tool_output(text: str) -> tuple[str, dict[str, Any]] | None:
    """(tool name, arguments) of a generated answer, or None when the model chose `no_tool`."""
    try:
        call = json.loads(text)
        function = dict(call["function"])
        name = function.pop("_name")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ToolFailed(f"Failed to parse generated text: {err} {text!r}") from err
    return None if name == NO_TOOL else (str(name), function)


def tool_call_json(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {
        "description": None, "name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}}


class ToolCallStream:
    """Turns the streamed text of a tool answer into argument fragments (see module docstring).

    `push` returns the fragments to send: (function name or None, arguments text); it returns
    None when the model chose `no_tool` (the caller then answers without tools).
    """

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.pending = ""  # argument text held back: it may end with the document's outer `}`
        self.done = False

    def push(self, token_text: str) -> list[tuple[str | None, str]] | None:
        if self.done:
            return []
        self.text += token_text
        if self.name is None:
            return self._head()
        self.pending += token_text
        return self._arguments()

    def _head(self) -> list[tuple[str | None, str]] | None:
        match = _HEAD.match(self.text)
        if match is None:
            return []
        name = json.loads(f'"{match.group(1)}"')
        if name == NO_TOOL:
            return None
        rest = self.text[match.end():].lstrip(" \t\n,")
        if not rest:
            return []  # wait: the next characters may only separate the name from the arguments
        self.name = name
        self.pending = rest
        return [(name, "{"), *self._arguments()]

    def _arguments(self) -> list[tuple[str | None, str]]:
        try:
            json.loads(self.text)
        except json.JSONDecodeError:
            cut = self.pending.rfind("}")  # hold back from the last `}`: it may close the document
            sent, self.pending = (self.pending, "") if cut < 0 else (self.pending[:cut], self.pending[cut:])
            return [(None, sent)] if sent else []
        self.done = True
        sent = self.pending.rstrip()
        return [(None, sent[:-1])] if sent[:-1] else []
