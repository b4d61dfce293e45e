"""One HTTP generation request from arrival to answer: the part every generation route shares.

A route starts a `Lifecycle` (the request is counted), translates its body in `prepare`
(template, tools, parameters: refused before any slot is taken), and runs its work with
`answer` (one result) or `stream` (SSE chunks). Both take one of max_concurrent_requests
(429 when none is free), count a failure under its error's metric label or, once, the
success and tgi_request_duration. Errors are answered as the route's shape wants them:
raised to the app's InferError handler (or mapped first, as /vertex does), or written as a
last SSE event of the stream, which stays 200.

A client that leaves cancels the work: `answer` waits for its result or the disconnect
(ClientGone, answered 499), a stream is cancelled by Starlette. Neither counts a failure
here; Infer counts the request `dropped` where it stopped waiting, and the slot is freed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from text_generation_router.engine.errors import InferError
from text_generation_router.engine.infer import FinishedGeneration, Timing
from text_generation_router.http import sse
from text_generation_router.http.connection import unless_disconnected
from text_generation_router.http.responses import generate_headers, stream_headers
from text_generation_router.http.state import AppState

T = TypeVar("T")

ErrorChunk = Callable[[InferError], bytes]
"""The SSE event a stream ends with when its request fails (native or OpenAI shape)."""


class Lifecycle:
    """One HTTP request on a generation route; `timing` starts when it arrives."""

    def __init__(self, state: AppState, http: Request) -> None:
        self.infer = state.infer
        self.compute_type = state.env.compute_type
        self.http = http
        self.timing = Timing()

    @classmethod
    def start(cls, state: AppState, http: Request) -> Lifecycle:
        """The lifecycle of a request just arrived: counted in tgi_request_count."""
        state.metrics.request_count.inc()
        return cls(state, http)

    def headers(self, g: FinishedGeneration, num_characters: int) -> dict[str, str]:
        """The x-* headers of a non-streaming answer of `g`."""
        return generate_headers(g, self.timing, num_characters, self.compute_type)

    def prepare(self, translate: Callable[[], T]) -> T:
        """The route's translation of its body; its refusal is counted and raised as itself."""
        try:
            return translate()
        except InferError as err:
            self._failed(err)
            raise

    async def prepare_async(self, translate: Callable[[], Awaitable[T]]) -> T:
        """`prepare` of a translation that awaits (a chat template rendered on a worker)."""
        try:
            return await translate()
        except InferError as err:
            self._failed(err)
            raise

    async def answer(
        self, work: Callable[[], Awaitable[T]], fail: Callable[[InferError], InferError] | None = None,
        slots: int = 1,
    ) -> T:
        """The result of `work`, run in `slots` slots (one per generation) until it is done or
        the client left.

        An InferError is counted under its own label and raised, as `fail(err)` when given.
        """
        try:
            result = await unless_disconnected(self.http, self._in_slots(work, slots))
        except InferError as err:
            self._failed(err)
            if fail is not None:
                raise fail(err) from err
            raise
        self._succeeded()
        return result

    def stream(
        self, events: Callable[[], AsyncGenerator[bytes, None]], error_event: ErrorChunk,
        num_characters: int, done: bytes | None = None, slots: int = 1,
    ) -> StreamingResponse:
        """An SSE answer of `events`, run in `slots` slots; always 200, a failure is its last event.

        `done` ends the stream either way (the OpenAI routes' `data: [DONE]`).
        """
        return StreamingResponse(
            sse.with_keep_alive(self._stream(events, error_event, done, slots)),
            media_type="text/event-stream", headers=stream_headers(num_characters, self.compute_type),
        )

    async def _in_slots(self, work: Callable[[], Awaitable[T]], slots: int) -> T:
        async with self.infer.slot(slots):
            return await work()

    async def _stream(
        self, events: Callable[[], AsyncGenerator[bytes, None]], error_event: ErrorChunk, done: bytes | None,
        slots: int,
    ) -> AsyncGenerator[bytes, None]:
        try:
            async with self.infer.slot(slots), contextlib.aclosing(events()) as chunks:
                async for chunk in chunks:
                    yield chunk
        except InferError as err:
            self._failed(err)
            yield error_event(err)
        else:
            self._succeeded()
        if done is not None:
            yield done

    def _failed(self, err: InferError) -> None:
        self.infer.metrics.request_failure.labels(err=err.metric_label).inc()

    def _succeeded(self) -> None:
        self.infer.metrics.request_success.inc()
        self.infer.metrics.request_duration.observe(time.monotonic() - self.timing.started)
