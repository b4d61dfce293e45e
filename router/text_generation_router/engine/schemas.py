"""HTTP request bodies (pydantic): shapes and wire types only; value checks live in validation.py.

Every field has upstream's Rust type (wire_types.py): a body whose field does not fit its type
is refused before validation, as upstream's serde extractor does (422, plain text).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, Field, model_validator

from text_generation_router.engine.wire_types import (
    Bool,
    OptBool,
    OptF32,
    OptI32,
    OptStr,
    OptU32,
    OptU64,
    Str,
)


class Grammar(BaseModel):
    """A grammar (`parameters.grammar`, chat `response_format`): TGI's `{type, value}`.

    `json_schema` takes its `{name?, schema}` from `value` or, as OpenAI's clients send it,
    from `json_schema`; OpenAI's JSON mode `{"type": "json_object"}` without a value asks for
    any JSON object.
    """

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any = None
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _has_value(self) -> Grammar:
        if self.type == "json_schema":
            config = self.value if self.value is not None else self.json_schema
            if not isinstance(config, dict):
                raise ValueError("a `json_schema` grammar needs `value` (or `json_schema`) = {name?, schema}")
            if "schema" not in config:
                raise ValueError("missing field `schema`")
        elif self.type in ("json", "regex") and self.value is None:
            raise ValueError("missing field `value`")
        return self


class GenerateParameters(BaseModel):
    best_of: OptU64 = None
    decoder_input_details: Bool = False
    details: Bool = False
    do_sample: Bool = False
    frequency_penalty: OptF32 = None
    grammar: Grammar | None = None
    max_new_tokens: OptU32 = None
    repetition_penalty: OptF32 = None
    return_full_text: OptBool = None
    seed: OptU64 = None
    stop: list[Str] = Field(default_factory=list)
    temperature: OptF32 = None
    top_k: OptI32 = None
    top_n_tokens: OptU32 = None
    top_p: OptF32 = None
    truncate: OptU64 = None
    typical_p: OptF32 = None
    watermark: Bool = False
    adapter_id: OptStr = None
    # Extension of this fork: per-request layer-skip mode.
    layer_skip: OptStr = None


class GenerateRequest(BaseModel):
    inputs: Str
    parameters: GenerateParameters | None = None
    add_special_tokens: Bool = True

    def effective_parameters(self) -> GenerateParameters:
        """An absent `parameters` object means sampling (docs/tgi-interface.md §8 gotcha 4)."""
        if self.parameters is None:
            return GenerateParameters(do_sample=True)
        return self.parameters


class CompatGenerateRequest(GenerateRequest):
    stream: Bool = False


class StreamOptions(BaseModel):
    include_usage: Bool = False


class ImageUrl(BaseModel):
    url: Str


class TextPart(BaseModel):
    type: Literal["text"]
    text: Str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    """One chat message: text content (a string or parts), or tool calls (upstream's MessageBody)."""

    role: Str
    content: Str | list[ContentPart] | None = None
    name: OptStr = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: OptStr = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _has_body(self) -> Message:
        if self.content is None and self.tool_calls is None:
            raise ValueError("a message needs `content` or `tool_calls`")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates of text models expect it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content if isinstance(p, TextPart))
        if content is None and self.tool_calls is not None:  # upstream renders tool calls as their JSON
            content = json.dumps(self.tool_calls, separators=(",", ":"))
        out: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(BaseModel):
    """A function a tool calls; `parameters` (OpenAI) or `arguments` (TGI) hold its JSON schema."""

    name: Str
    description: OptStr = None
    arguments: Any = Field(default=None, validation_alias=AliasChoices("arguments", "parameters"))


class Tool(BaseModel):
    type: Str = "function"
    function: FunctionDefinition


class ChatRequest(BaseModel):
    model: OptStr = None
    messages: list[Message]
    max_tokens: OptU32 = None
    max_completion_tokens: OptU32 = None
    temperature: OptF32 = None
    top_p: OptF32 = None
    seed: OptU64 = None
    stop: list[Str] | Str | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: OptF32 = None
    presence_penalty: OptF32 = None
    logprobs: OptBool = None
    top_logprobs: OptU32 = None
    response_format: Grammar | None = None
    n: OptU32 = None
    logit_bias: dict[Str, OptF32] | list[OptF32] | None = None
    tools: list[Tool] | None = None
    tool_choice: Str | dict[str, Any] | None = None
    tool_prompt: OptStr = None
    parallel_tool_calls: OptBool = None
    user: OptStr = None
    functions: list[dict[str, Any]] | None = None
    function_call: Str | dict[str, Any] | None = None


class CompletionRequest(BaseModel):
    model: OptStr = None
    prompt: Str | list[Str]
    max_tokens: OptU32 = None
    temperature: OptF32 = None
    top_p: OptF32 = None
    seed: OptU64 = None
    stop: list[Str] | Str | None = None
    stream: Bool = False
    repetition_penalty: OptF32 = None
    frequency_penalty: OptF32 = None
    presence_penalty: OptF32 = None
    suffix: OptStr = None
    logprobs: OptU32 = None
    n: OptU32 = None
    best_of: OptU32 = None
    echo: OptBool = None
    logit_bias: dict[Str, OptF32] | None = None
    user: OptStr = None
