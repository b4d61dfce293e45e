"""POST /v1/completions (docs/tgi-interface.md §2.6): each prompt is a generate request (special tokens added,
as upstream); streams interleave the prompts' chunks and end with `data: [DONE]`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request, Response

from text_generation_router.engine.events import Token, TokenEvent
from text_generation_router.engine.infer import Timing, run_together
from text_generation_router.engine.schemas import CompletionRequest, GenerateParameters
from text_generation_router.http import sse
from text_generation_router.http.lifecycle import Lifecycle
from text_generation_router.http.openai_shapes import (
    FINGERPRINT,
    OPENAI_FINISH,
    OpenAIError,
    adapter,
    error_event,
    new_id,
    now,
    presence_as_repetition,
    refuse_unserved,
    sampling,
    stops,
    usage,
)
from text_generation_router.http.state import AppState


def completion_parameters(req: CompletionRequest, state: AppState) -> tuple[list[str], GenerateParameters]:
    prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if req.suffix is not None:
        raise OpenAIError("suffix not supported", "Suffix is not supported and can give wrong results.")
    refuse_unserved(n=req.n, best_of=req.best_of, echo=req.echo, logit_bias=req.logit_bias)
    if req.logprobs is not None and req.logprobs > state.config.max_top_n_tokens:
        raise OpenAIError("validation", f"`logprobs` must be <= {state.config.max_top_n_tokens} "
                                        f"(--max-top-n-tokens). Given: {req.logprobs}")
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
        repetition_penalty=presence_as_repetition(req.presence_penalty, req.repetition_penalty),
        frequency_penalty=req.frequency_penalty, top_n_tokens=req.logprobs or None,
        details=True, adapter_id=adapter(req.model, state),
    )
    return prompts, p


class Envelope:
    """What every chunk (or the one body) of a completion repeats: one id, one creation time."""

    def __init__(self, state: AppState) -> None:
        self.head = {"object": "text_completion", "id": new_id("cmpl-"), "created": now(),
                     "model": state.model_id, "system_fingerprint": FINGERPRINT}

    def body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.head, "choices": choices}


def _logprobs(tokens: list[Token], tops: list[list[Token]], offset: int) -> dict[str, Any]:
    """OpenAI's completion logprobs: each token, its logprob, its top alternatives (as many as
    `logprobs` asked) and where its text starts (counted from the prompt's start)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{x.text: x.logprob for x in top} for top in tops] if tops else None,
            "text_offset": offsets}


async def completion(state: AppState, http: Request, req: CompletionRequest) -> Response:
    call = Lifecycle.start(state, http)
    prompts, p = call.prepare(lambda: completion_parameters(req, state))
    if req.stream:
        return call.stream(lambda: _completion_events(state, prompts, p, req.logprobs is not None), error_event,
                           sum(len(x) for x in prompts), sse.DONE, slots=len(prompts))
    gens = await call.answer(lambda: run_together([state.infer.complete(x, p, Timing(), True) for x in prompts]),
                             slots=len(prompts))
    choices = [{"index": i, "text": g.generated.text,
                "logprobs": _logprobs(g.tokens, g.top_tokens, len(x)) if req.logprobs is not None else None,
                "finish_reason": OPENAI_FINISH[g.generated.finish_reason]}
               for i, (g, x) in enumerate(zip(gens, prompts, strict=True))]
    body = Envelope(state).body(choices)
    body["usage"] = usage(sum(g.request.input_length for g in gens), sum(g.generated.generated_tokens for g in gens),
                          sum(g.generated.cached_tokens for g in gens))
    return sse.NanSafeJSONResponse(body)


async def _completion_events(
    state: AppState, prompts: list[str], p: GenerateParameters, with_logprobs: bool
) -> AsyncGenerator[bytes, None]:
    """Chunks of all prompts interleaved as they come; each prompt's last chunk has usage.
    A prompt's failure is raised once the chunks before it are out."""
    out: asyncio.Queue[bytes | None] = asyncio.Queue()
    envelope = Envelope(state)

    async def one(index: int, prompt: str) -> None:
        timing = Timing()
        request = await state.infer.validate(prompt, p, add_special_tokens=True)
        offset = len(prompt)
        async for event in state.infer.stream(request, timing):
            if not isinstance(event, TokenEvent):
                continue
            end = event.end
            logprobs = _logprobs([event.token], [event.top_tokens] if event.top_tokens else [], offset) \
                if with_logprobs else None
            offset += len(event.token.text)
            body = envelope.body([{
                "index": index, "text": event.token.text, "logprobs": logprobs,
                "finish_reason": None if end is None else OPENAI_FINISH[end.finish_reason]}])
            if end is not None:
                body["usage"] = usage(request.input_length, end.generated_tokens, end.cached_tokens)
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
