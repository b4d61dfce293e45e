"""Chat routes: /v1/chat/completions (docs/tgi-interface.md §2.5) and /chat_tokenize.

A chat request becomes one generate request: the chat template renders the messages (a
trailing assistant message is continued), `response_format` or the tools become its grammar
(tools.py), and the answer is text, or `tool_calls` parsed from the tool grammar's JSON. When
the model picks upstream's `no_tool`, the request is answered again without tools. Streams end
with `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from text_generation_router.engine.errors import TemplateFailed
from text_generation_router.engine.events import TokenEvent
from text_generation_router.engine.infer import FinishedGeneration, Timing
from text_generation_router.engine.schemas import ChatRequest, CompletionRequest, GenerateParameters, Grammar
from text_generation_router.engine.tokenizer import TemplateError
from text_generation_router.http import sse
from text_generation_router.http.completions import completion
from text_generation_router.http.connection import unless_disconnected
from text_generation_router.http.http_body import read_json
from text_generation_router.http.lifecycle import Lifecycle
from text_generation_router.http.openai_shapes import (
    FINGERPRINT,
    OPENAI_FINISH,
    TOOL_CALLS,
    adapter,
    error_event,
    logprobs_json,
    new_id,
    now,
    presence_as_repetition,
    refuse_unserved,
    sampling,
    stops,
    usage,
)
from text_generation_router.http.openapi import body_route, json_ok, json_or_sse_ok
from text_generation_router.http.state import AppState
from text_generation_router.http.tools import (
    ToolCallStream,
    ToolChoice,
    ToolFailed,
    add_tools_to_prompt,
    parse_tool_output,
    template_tools,
    tool_call_json,
    tool_schema,
    tools_to_use,
)


@dataclass(frozen=True)
class ChatPlan:
    """A chat request as one generate request."""

    prompt: str
    params: GenerateParameters
    using_tools: bool


async def plan_chat(req: ChatRequest, state: AppState, with_tools: bool = True) -> ChatPlan:
    """Template, grammar and parameters of a chat request (`with_tools=False`: the no_tool rerun);
    the template renders on a validation worker, not on the event loop (a long conversation takes
    seconds to render)."""
    refuse_unserved(n=req.n, logit_bias=req.logit_bias, functions=req.functions, function_call=req.function_call)
    if req.response_format is not None and req.tools is not None:
        raise ToolFailed("Grammar and tools are mutually exclusive")
    messages = [m.template_dict() for m in req.messages]
    grammar = req.response_format
    rendered_tools = None
    used = tools_to_use(req.tools, ToolChoice.parse(req.tool_choice)) if with_tools and req.tools else []
    if used:
        grammar = Grammar(type="json", value=tool_schema(used))
        add_tools_to_prompt(messages, used, req.tool_prompt, state.tokenizer.template_uses_tools)
        rendered_tools = template_tools(used) if state.tokenizer.template_uses_tools else None
    try:
        prompt = await state.infer.render_chat(messages, rendered_tools)
    except TemplateError as err:
        raise TemplateFailed(str(err)) from err
    do_sample, temperature = sampling(req.temperature)
    params = GenerateParameters(
        do_sample=do_sample, temperature=temperature, top_p=req.top_p, seed=req.seed,
        max_new_tokens=req.max_tokens if req.max_tokens is not None else req.max_completion_tokens,
        stop=stops(req.stop), frequency_penalty=req.frequency_penalty,
        repetition_penalty=presence_as_repetition(req.presence_penalty),
        top_n_tokens=req.top_logprobs if req.logprobs else None, details=True,
        grammar=grammar, adapter_id=adapter(req.model, state),
    )
    return ChatPlan(prompt, params, bool(used))


def response_model(req: ChatRequest, state: AppState) -> str:
    """Upstream echoes the request's model, except `tgi` or none."""
    return state.model_id if req.model in (None, "tgi") else req.model


async def chat_completion(state: AppState, http: Request, req: ChatRequest) -> Response:
    call = Lifecycle.start(state, http)
    plan = await call.prepare_async(lambda: plan_chat(req, state))
    if req.stream:
        return call.stream(lambda: _chat_events(state, req, plan), error_event, len(plan.prompt), sse.DONE)
    g, message, plan = await call.answer(lambda: _chat_answer(state, req, plan, call.timing))
    finish = TOOL_CALLS if "tool_calls" in message else OPENAI_FINISH[g.generated.finish_reason]
    body = {
        "object": "chat.completion", "id": new_id("chatcmpl-"), "created": now(),
        "model": response_model(req, state), "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs_json(g) if req.logprobs else None,
                     "finish_reason": finish}],
        "usage": usage(g.request.input_length, g.generated.generated_tokens, g.generated.cached_tokens),
    }
    return sse.NanSafeJSONResponse(body, headers=call.headers(g, len(plan.prompt)))


async def _chat_answer(
    state: AppState, req: ChatRequest, plan: ChatPlan, timing: Timing
) -> tuple[FinishedGeneration, dict[str, Any], ChatPlan]:
    """The generation, message and plan that answered: a model that chose no_tool is asked
    again, without tools."""
    g = await state.infer.complete(plan.prompt, plan.params, timing, False)
    if plan.using_tools:
        call = parse_tool_output(g.generated.text)
        if call is not None:
            return g, {"role": "assistant", "tool_calls": [tool_call_json(*call, new_id("call_"))]}, plan
        plan = await plan_chat(req, state, with_tools=False)
        g = await state.infer.complete(plan.prompt, plan.params, timing, False)
    return g, {"role": "assistant", "content": g.generated.text}, plan


@dataclass(frozen=True)
class StreamIds:
    """What every chunk of one streamed answer repeats: its id, creation time and model, and the
    id of its tool call (if it makes one)."""

    model: str
    completion_id: str = field(default_factory=lambda: new_id("chatcmpl-"))
    created: int = field(default_factory=now)
    call_id: str = field(default_factory=lambda: new_id("call_"))

    def chunk(self, choices: list[dict[str, Any]], usage_json: Any = None) -> bytes:
        return sse.event({"object": "chat.completion.chunk", "id": self.completion_id, "created": self.created,
                          "model": self.model, "system_fingerprint": FINGERPRINT, "choices": choices,
                          "usage": usage_json})


def _token_logprobs(event: TokenEvent) -> dict[str, Any]:
    t = event.token
    return {"content": [{"token": t.text, "logprob": t.logprob, "top_logprobs": [
        {"token": x.text, "logprob": x.logprob} for x in event.top_tokens]}]}


def _tool_delta(call_id: str, name: str | None, arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                                 "function": {"name": name, "arguments": arguments}}]}


async def _chat_events(state: AppState, req: ChatRequest, plan: ChatPlan) -> AsyncGenerator[bytes, None]:
    ids = StreamIds(response_model(req, state))
    declined = [False]  # set when the model chose no_tool: the request is answered again without tools
    async for chunk in _plan_chunks(state, req, plan, ids, declined):
        yield chunk
    if declined[0]:
        plain = await plan_chat(req, state, with_tools=False)
        async for chunk in _plan_chunks(state, req, plain, ids, declined):
            yield chunk


async def _plan_chunks(state: AppState, req: ChatRequest, plan: ChatPlan, ids: StreamIds,
                       declined: list[bool]) -> AsyncIterator[bytes]:
    """The chunks of one generate request: content deltas, or tool-call argument deltas."""
    tools = ToolCallStream() if plan.using_tools else None
    request = await state.infer.validate(plan.prompt, plan.params, add_special_tokens=False)
    async with contextlib.aclosing(state.infer.stream(request, Timing(validated=time.monotonic()))) as events:
        async for event in events:
            if not isinstance(event, TokenEvent):
                continue
            end, text = event.end, "" if event.token.special else event.token.text
            finish = None if end is None else OPENAI_FINISH[end.finish_reason]
            logprobs = _token_logprobs(event) if req.logprobs else None
            if tools is None:
                deltas = [{"role": "assistant", "content": text}]
            else:
                fragments = tools.push(text)
                if fragments is None:
                    declined[0] = True
                    return
                if end is not None and not fragments:
                    fragments = [(None, "")]  # the finish_reason needs a chunk
                if finish == OPENAI_FINISH["eos_token"]:  # the tool call is complete
                    finish = TOOL_CALLS
                deltas = [_tool_delta(ids.call_id, name, arguments) for name, arguments in fragments]
            for n, delta in enumerate(deltas):
                last = n == len(deltas) - 1
                yield ids.chunk([{"index": 0, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish if last else None}])
            if end is not None:
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield ids.chunk([], usage(request.input_length, end.generated_tokens, end.cached_tokens))
                return


async def chat_tokenize(state: AppState, req: ChatRequest) -> JSONResponse:
    """The templated prompt of a chat request and its tokens (upstream's /chat_tokenize)."""
    state.metrics.request_count.inc()
    plan = await plan_chat(req, state)
    spans = await state.infer.tokenize(plan.prompt, add_special_tokens=False)
    return JSONResponse({"tokenize_response": [{"id": s.id, "text": s.text, "start": s.start, "stop": s.stop}
                                               for s in spans], "templated_text": plan.prompt})


def register_openai_routes(app: FastAPI, state: AppState) -> None:
    limit = state.config.payload_limit

    @app.post("/v1/chat/completions", openapi_extra=body_route(
        ChatRequest, json_or_sse_ok("ChatCompletion, or chat.completion.chunk events ending with [DONE]")))
    async def chat(request: Request) -> Response:
        body = await read_json(request, ChatRequest, limit)
        return await chat_completion(state, request, body)

    @app.post("/v1/completions", openapi_extra=body_route(
        CompletionRequest, json_or_sse_ok("CompletionFinal, or text_completion events ending with [DONE]")))
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, limit)
        return await completion(state, request, body)

    @app.post("/chat_tokenize", openapi_extra=body_route(ChatRequest, json_ok(
        "The templated prompt (templated_text) and its tokens (tokenize_response)")))
    async def tokenize_chat(request: Request) -> Response:
        body = await read_json(request, ChatRequest, limit)
        return await unless_disconnected(request, chat_tokenize(state, body))


__all__ = ["register_openai_routes"]
