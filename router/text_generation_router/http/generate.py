"""The native generation routes: POST /generate, /generate_stream and / (docs/tgi-interface.md §2.1-2.4)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import StreamingResponse

from text_generation_router.engine.errors import IncompleteStream, InferError, ValidationFailed
from text_generation_router.engine.events import TokenEvent
from text_generation_router.engine.infer import FinishedGeneration, Timing, run_together
from text_generation_router.engine.schemas import GenerateRequest
from text_generation_router.engine.validation import ValidationError, validate_best_of
from text_generation_router.http import sse
from text_generation_router.http.lifecycle import Lifecycle
from text_generation_router.http.responses import generate_json, stream_token_json
from text_generation_router.http.state import AppState


def _mean_logprob(g: FinishedGeneration) -> float:
    if not g.tokens:
        return float("-inf")
    return sum(t.logprob for t in g.tokens) / len(g.tokens)


async def run_generate(
    state: AppState, req: GenerateRequest, timing: Timing
) -> tuple[FinishedGeneration, list[FinishedGeneration]]:
    """Validate and run one request (or best_of copies); returns (best, others)."""
    p = req.effective_parameters()
    best_of = p.best_of if p.best_of is not None else 1
    if best_of != 1:
        try:
            validate_best_of(best_of, state.config.max_best_of)
        except ValidationError as err:
            raise ValidationFailed(str(err)) from err
    requests = [
        await state.infer.validate(req.inputs, p, req.add_special_tokens) for _ in range(best_of)
    ]
    timing.validated = time.monotonic()
    generations = await run_together([state.infer.generate(r, timing) for r in requests])
    ranked = sorted(generations, key=_mean_logprob, reverse=True)
    return ranked[0], ranked[1:]


def error_event(err: InferError) -> bytes:
    """The native stream's last event when its request fails."""
    return sse.event({"error": err.message, "error_type": err.error_type})


async def generate_response(
    state: AppState, http: Request, req: GenerateRequest, default_full_text: bool, as_list: bool
) -> sse.NanSafeJSONResponse:
    """Non-streaming answer of /generate (object) or / (one-item list)."""
    call = Lifecycle.start(state, http)
    p = req.effective_parameters()
    copies = p.best_of if p.best_of is not None and 1 <= p.best_of <= state.config.max_best_of else 1
    best, others = await call.answer(lambda: run_generate(state, req, call.timing), slots=copies)
    full = p.return_full_text if p.return_full_text is not None else default_full_text
    details = p.details or p.decoder_input_details
    body = generate_json(best, details, full, others)
    headers = call.headers(best, len(req.inputs))
    return sse.NanSafeJSONResponse([body] if as_list else body, headers=headers)


async def _stream_events(
    state: AppState, req: GenerateRequest, default_full_text: bool, timing: Timing
) -> AsyncGenerator[bytes, None]:
    p = req.effective_parameters()
    if p.best_of is not None and p.best_of != 1:
        raise ValidationFailed("`best_of` != 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        raise ValidationFailed("`decoder_input_details` == true is not supported when streaming tokens")
    request = await state.infer.validate(req.inputs, p, req.add_special_tokens)
    timing.validated = time.monotonic()
    full = p.return_full_text if p.return_full_text is not None else default_full_text
    prefix = req.inputs if full else ""
    index = 0
    async with contextlib.aclosing(state.infer.stream(request, timing)) as events:
        async for event in events:
            if not isinstance(event, TokenEvent):
                continue
            index += 1
            yield sse.event(stream_token_json(
                index, event.token, event.top_tokens, event.end, p.details, prefix, request.input_length,
            ))
            if event.end is not None:
                return
    raise IncompleteStream()


def stream_response(
    state: AppState, http: Request, req: GenerateRequest, default_full_text: bool
) -> StreamingResponse:
    """SSE of StreamResponse events; always 200, errors arrive as events (no [DONE])."""
    call = Lifecycle.start(state, http)
    return call.stream(lambda: _stream_events(state, req, default_full_text, call.timing), error_event,
                       len(req.inputs))
