"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions (spec §2.5, §2.6).

Both map their body onto GenerateParameters and reuse Infer; chat renders the tokenizer's
chat template first. Streams end with `data:[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from text_generation_router import __version__, sse
from text_generation_router.connection import unless_disconnected
from text_generation_router.errors import InferError, TemplateFailed
from text_generation_router.events import TokenEvent
from text_generation_router.http_body import read_json
from text_generation_router.infer import Generation, Timing, run_together
from text_generation_router.openapi import body_route, json_or_sse_ok
from text_generation_router.responses import generate_headers, stream_headers
from text_generation_router.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerateParameters,
    Grammar,
)
from text_generation_router.state import AppState
from text_generation_router.tokenizer import TemplateError

FINGERPRINT = f"{__version__}-native"
OPENAI_FINISH = {"eos_token": "stop", "length": "length", "stop_sequence": "stop_sequence"}


class OpenAIError(InferError):
    status = 422

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.metric_label = "validation"


def _sampling(temperature: float | None) -> tuple[bool, float | None]:
    """Temperature 0 means greedy; anything else, absent included, samples (§8.6)."""
    if temperature == 0:
        return False, None
    return True, temperature


def _stops(stop: list[str] | str | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _adapter(model: str | None, state: AppState) -> str | None:
    if model in (None, "", "tgi", state.model_id, state.config.tokenizer_name):
        return None
    return model


def chat_parameters(req: ChatRequest, state: AppState) -> GenerateParameters:
    do_sample, temperature = _sampling(req.temperature)
    if req.tools is not None:
        raise OpenAIError("tool_error", "Tool error: tools are not supported by this router")
    return GenerateParameters(
        do_sample=do_sample, temperature=temperature, top_p=req.top_p, seed=req.seed,
        max_new_tokens=req.max_tokens if req.max_tokens is not None else req.max_completion_tokens,
        stop=_stops(req.stop), frequency_penalty=req.frequency_penalty,
        repetition_penalty=None if req.presence_penalty is None else req.presence_penalty + 2.0,
        top_n_tokens=req.top_logprobs if req.logprobs else None, details=True,
        grammar=req.response_format, adapter_id=_adapter(req.model, state),
    )


def render_prompt(req: ChatRequest, state: AppState) -> str:
    try:
        return state.tokenizer.apply_chat_template([m.template_dict() for m in req.messages])
    except TemplateError as err:
        raise TemplateFailed(str(err)) from err


def _logprobs_json(g: Generation) -> dict[str, Any]:
    content = []
    for n, t in enumerate(g.tokens):
        top = g.top_tokens[n] if n < len(g.top_tokens) else []
        content.append({"token": t.text, "logprob": t.logprob,
                        "top_logprobs": [{"token": x.text, "logprob": x.logprob} for x in top]})
    return {"content": content}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _generate_one(
    state: AppState, prompt: str, p: GenerateParameters, timing: Timing
) -> Generation:
    request = await state.infer.validate(prompt, p, add_special_tokens=False)
    timing.validated = time.monotonic()
    return await state.infer.generate(request, timing)


async def chat_completion(state: AppState, req: ChatRequest) -> Response:
    timing = Timing()
    state.metrics.request_count.inc()
    try:
        p = chat_parameters(req, state)
        prompt = render_prompt(req, state)
        if req.stream:
            return _chat_stream(state, req, p, prompt)
        async with state.infer.slot():
            g = await _generate_one(state, prompt, p, timing)
    except InferError as err:
        state.metrics.request_failure.labels(err=err.metric_label).inc()
        raise
    state.metrics.request_success.inc()
    body = {
        "object": "chat.completion", "id": "", "created": int(time.time()),
        "model": state.model_id, "system_fingerprint": FINGERPRINT,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": g.generated.text},
            "logprobs": _logprobs_json(g) if req.logprobs else None,
            "finish_reason": OPENAI_FINISH[g.generated.finish_reason],
        }],
        "usage": _usage(g.request.input_length, g.generated.generated_tokens),
    }
    return sse.NanSafeJSONResponse(body, headers=generate_headers(g, timing, len(prompt)))


def _chunk(state: AppState, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
    return sse.event({
        "object": "chat.completion.chunk", "id": "", "created": int(time.time()),
        "model": state.model_id, "system_fingerprint": FINGERPRINT, "choices": choices,
        "usage": usage,
    })


async def _chat_events(
    state: AppState, req: ChatRequest, p: GenerateParameters, prompt: str
) -> AsyncIterator[bytes]:
    timing = Timing()
    try:
        async with state.infer.slot():
            request = await state.infer.validate(prompt, p, add_special_tokens=False)
            timing.validated = time.monotonic()
            async for event in state.infer.stream(request, timing):
                if not isinstance(event, TokenEvent):
                    continue
                t = event.token
                logprobs = None
                if req.logprobs:
                    logprobs = {"content": [{"token": t.text, "logprob": t.logprob, "top_logprobs": [
                        {"token": x.text, "logprob": x.logprob} for x in event.top_tokens]}]}
                finish = None if event.end is None else OPENAI_FINISH[event.end.finish_reason]
                delta = {"role": "assistant", "content": "" if t.special else t.text}
                yield _chunk(state, [{"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish}])
                if event.end is not None:
                    state.metrics.request_success.inc()
                    if req.stream_options is not None and req.stream_options.include_usage:
                        usage = _usage(request.input_length, event.end.generated_tokens)
                        yield _chunk(state, [], usage)
                    break
    except InferError as err:
        state.metrics.request_failure.labels(err=err.metric_label).inc()
        yield sse.event({"error": {"message": err.message, "http_status_code": 422}})
    yield sse.DONE


def _chat_stream(state: AppState, req: ChatRequest, p: GenerateParameters, prompt: str) -> StreamingResponse:
    return StreamingResponse(sse.with_keep_alive(_chat_events(state, req, p, prompt)), media_type="text/event-stream",
                             headers=stream_headers(len(prompt)))


def completion_parameters(req: CompletionRequest, state: AppState) -> tuple[list[str], GenerateParameters]:
    prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if req.suffix is not None:
        raise OpenAIError("suffix not supported", "Suffix is not supported and can give wrong results.")
    if not prompts or len(prompts) > state.config.max_client_batch_size:
        raise OpenAIError(
            "batch size exceeded",
            f"Number of prompts exceeds the maximum allowed batch size of "
            f"{state.config.max_client_batch_size}",
        )
    do_sample, temperature = _sampling(req.temperature)
    p = GenerateParameters(
        do_sample=do_sample, temperature=temperature, top_p=req.top_p, seed=req.seed,
        max_new_tokens=req.max_tokens, stop=_stops(req.stop),
        repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
        details=True, adapter_id=_adapter(req.model, state),
    )
    return prompts, p


def _completion_envelope(state: AppState, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "text_completion", "id": "", "created": int(time.time()),
            "model": state.model_id, "system_fingerprint": FINGERPRINT, "choices": choices}


async def completion(state: AppState, req: CompletionRequest) -> Response:
    state.metrics.request_count.inc()
    try:
        prompts, p = completion_parameters(req, state)
        if req.stream:
            return StreamingResponse(sse.with_keep_alive(_completion_events(state, prompts, p)),
                                     media_type="text/event-stream",
                                     headers=stream_headers(sum(len(x) for x in prompts)))
        async with state.infer.slot():
            gens = await run_together([_generate_one(state, x, p, Timing()) for x in prompts])
    except InferError as err:
        state.metrics.request_failure.labels(err=err.metric_label).inc()
        raise
    state.metrics.request_success.inc()
    choices = [{"index": i, "text": g.generated.text, "logprobs": None,
                "finish_reason": OPENAI_FINISH[g.generated.finish_reason]} for i, g in enumerate(gens)]
    body = _completion_envelope(state, choices)
    body["usage"] = _usage(sum(g.request.input_length for g in gens),
                           sum(g.generated.generated_tokens for g in gens))
    return JSONResponse(body)


async def _completion_events(
    state: AppState, prompts: list[str], p: GenerateParameters
) -> AsyncIterator[bytes]:
    """Chunks of all prompts interleaved as they come; each prompt's last chunk has usage."""
    out: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def one(index: int, prompt: str) -> None:
        timing = Timing()
        request = await state.infer.validate(prompt, p, add_special_tokens=False)
        async for event in state.infer.stream(request, timing):
            if not isinstance(event, TokenEvent):
                continue
            end = event.end
            body = _completion_envelope(state, [{
                "index": index, "text": event.token.text, "logprobs": None,
                "finish_reason": "" if end is None else end.finish_reason}])
            if end is not None:
                body["usage"] = _usage(request.input_length, end.generated_tokens)
            await out.put(sse.event(body))

    async def run_all() -> None:
        try:
            async with state.infer.slot():
                await run_together([one(i, x) for i, x in enumerate(prompts)])
        except InferError as err:
            state.metrics.request_failure.labels(err=err.metric_label).inc()
            await out.put(sse.event({"error": {"message": err.message, "http_status_code": 422}}))
        await out.put(None)

    task = asyncio.create_task(run_all())
    try:
        while (item := await out.get()) is not None:
            yield item
        yield sse.DONE
    finally:
        task.cancel()


def register_openai_routes(app: FastAPI, state: AppState) -> None:
    limit = state.config.payload_limit

    @app.post("/v1/chat/completions", openapi_extra=body_route(
        ChatRequest, json_or_sse_ok("ChatCompletion, or chat.completion.chunk events ending with [DONE]")))
    async def chat(request: Request) -> Response:
        body = await read_json(request, ChatRequest, limit)
        return await unless_disconnected(request, chat_completion(state, body))

    @app.post("/v1/completions", openapi_extra=body_route(
        CompletionRequest, json_or_sse_ok("CompletionFinal, or text_completion events ending with [DONE]")))
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, limit)
        return await unless_disconnected(request, completion(state, body))


__all__ = ["Grammar", "register_openai_routes"]
