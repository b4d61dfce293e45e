"""POST /v1/completions (docs/tgi-interface.md §2.6): each prompt is a generate request (special tokens added,
as upstream); streams interleave the prompts' chunks and end with `data: [DONE]`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from text_generation_router import sse
from text_generation_router.events import TokenEvent
from text_generation_router.infer import Timing, run_together
from text_generation_router.lifecycle import Lifecycle
from text_generation_router.openai_shapes import (
    FINGERPRINT,
    OPENAI_FINISH,
    OpenAIError,
    adapter,
    error_event,
    now,
    sampling,
    stops,
    usage,
)
from text_generation_router.schemas import CompletionRequest, GenerateParameters
from text_generation_router.state import AppState


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
    do_sample, temperature = sampling(req.temperature)
    p = GenerateParameters(
        do_sample=do_sample, temperature=temperature, top_p=req.top_p, seed=req.seed,
        max_new_tokens=req.max_tokens, stop=stops(req.stop),
        repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
        details=True, adapter_id=adapter(req.model, state),
    )
    return prompts, p


def _envelope(state: AppState, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "text_completion", "id": "", "created": now(),
            "model": state.model_id, "system_fingerprint": FINGERPRINT, "choices": choices}


async def completion(state: AppState, http: Request, req: CompletionRequest) -> Response:
    call = Lifecycle.start(state, http)
    prompts, p = call.prepare(lambda: completion_parameters(req, state))
    if req.stream:
        return call.stream(lambda: _completion_events(state, prompts, p), error_event,
                           sum(len(x) for x in prompts), sse.DONE, slots=len(prompts))
    gens = await call.answer(lambda: run_together([state.infer.complete(x, p, Timing(), True) for x in prompts]),
                             slots=len(prompts))
    choices = [{"index": i, "text": g.generated.text, "logprobs": None,
                "finish_reason": OPENAI_FINISH[g.generated.finish_reason]} for i, g in enumerate(gens)]
    body = _envelope(state, choices)
    body["usage"] = usage(sum(g.request.input_length for g in gens), sum(g.generated.generated_tokens for g in gens))
    return JSONResponse(body)


async def _completion_events(
    state: AppState, prompts: list[str], p: GenerateParameters
) -> AsyncGenerator[bytes, None]:
    """Chunks of all prompts interleaved as they come; each prompt's last chunk has usage.
    A prompt's failure is raised once the chunks before it are out."""
    out: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def one(index: int, prompt: str) -> None:
        timing = Timing()
        request = await state.infer.validate(prompt, p, add_special_tokens=True)
        async for event in state.infer.stream(request, timing):
            if not isinstance(event, TokenEvent):
                continue
            end = event.end
            body = _envelope(state, [{
                "index": index, "text": event.token.text, "logprobs": None,
                "finish_reason": "" if end is None else end.finish_reason}])
            if end is not None:
                body["usage"] = usage(request.input_length, end.generated_tokens)
            await out.put(sse.event(body))

    async def run_all() -> None:
        try:
            await run_together([one(i, x) for i, x in enumerate(prompts)])
        finally:
            await out.put(None)

    task = asyncio.create_task(run_all())
    try:
        while (item := await out.get()) is not None:
            yield item
        await task  # raises the prompt's error, if one failed
    finally:
        task.cancel()
