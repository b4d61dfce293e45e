"""HTTP request bodies (pydantic): shapes and types only; value checks live in validation.py."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Grammar(BaseModel):
    type: str
    value: Any = None


class GenerateParameters(BaseModel):
    best_of: int | None = Field(default=None, ge=0)
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: Grammar | None = None
    max_new_tokens: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = Field(default=None, ge=0)
    stop: list[str] = Field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = Field(default=None, ge=0)
    top_p: float | None = None
    truncate: int | None = Field(default=None, ge=0)
    typical_p: float | None = None
    watermark: bool = False
    adapter_id: str | None = None
    # Extension of this fork: per-request layer-skip mode.
    layer_skip: str | None = None


class GenerateRequest(BaseModel):
    inputs: str
    parameters: GenerateParameters | None = None
    add_special_tokens: bool = True

    def effective_parameters(self) -> GenerateParameters:
        """An absent `parameters` object means sampling (spec §8 gotcha 4)."""
        if self.parameters is None:
            return GenerateParameters(do_sample=True)
        return self.parameters


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Grammar | None = None
    n: int | None = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None


class CompletionRequest(BaseModel):
    model: str | None = None
    prompt: str | list[str]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stream: bool = False
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    suffix: str | None = None
