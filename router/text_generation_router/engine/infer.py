"""From an HTTP request to a stream of tokens: concurrency limit, validation, queueing.

`Infer.stream` yields TokenEvents (and a PrefillEvent when asked) and raises InferError;
`Infer.generate` collects them into a `FinishedGeneration` for the non-streaming routes. As upstream,
a request is served in chunks of at most 1024 new tokens: a chunk that ends by length before
the request's max_new_tokens is re-queued with its text appended to the prompt, until the
request is done or its next chunk no longer passes validation. Every generation route ends
in `Infer.stream`, which records `tgi_request_duration` once per finished request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from text_generation_router.engine.errors import (
    IncompleteGeneration,
    Overloaded,
    ShuttingDown,
    ValidationFailed,
    error_from_event,
)
from text_generation_router.engine.events import (
    ErrorEvent,
    GeneratedText,
    InferEvent,
    LayerSkipReport,
    PrefillEvent,
    Token,
    TokenEvent,
)
from text_generation_router.engine.metrics import Metrics
from text_generation_router.engine.queue import Queue
from text_generation_router.engine.schemas import GenerateParameters
from text_generation_router.engine.tokenizer import Tokenizer, TokenSpan
from text_generation_router.engine.validation import (
    DEFAULT_GENERATION_LENGTH,
    GRAMMAR_INVALID,
    GrammarCheck,
    Limits,
    ValidationError,
    ValidRequest,
    build_valid_request,
    check_grammar,
    check_json_schema,
    check_layer_skip,
    check_lengths,
    check_sampling_parameters,
    requested_new_tokens,
)

T = TypeVar("T")


async def run_together(works: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of requests that answer one HTTP call (best_of, several prompts), or the
    first error with the others cancelled: their requests are dropped, not left running."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class FinishedGeneration:
    """A finished request, as the non-streaming routes need it (the shard's pb.Generation is
    one step's output; this is the whole request's)."""

    request: ValidRequest
    generated: GeneratedText
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    prefill: list[Token] = field(default_factory=list)
    layer_skip: LayerSkipReport | None = None
    queued_s: float = 0.0
    inference_s: float = 0.0


@dataclass
class Timing:
    """Wall-clock marks of one request, for the x-*-time headers."""

    started: float = field(default_factory=time.monotonic)
    validated: float = 0.0
    first_batched: float = 0.0


class Infer:
    """Entry point of the generation routes."""

    def __init__(
        self, tokenizer: Tokenizer, queue: Queue, limits: Limits, metrics: Metrics,
        max_concurrent_requests: int, validation_workers: int,
        prepare_grammar: Callable[[str, int], Awaitable[str | None]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.queue = queue
        self.limits = limits
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0
        self.admitted = 0  # requests ever let in: slots taken and tokenizations (memory.py trims after bursts)
        self.draining = False  # set on SIGTERM (shutdown.py): new requests are refused
        self.prepare_grammar = prepare_grammar  # the shard's grammar compile: its refusal, or None
        self._pool = ThreadPoolExecutor(validation_workers, thread_name_prefix="validation")

    @asynccontextmanager
    async def slot(self, count: int = 1) -> AsyncIterator[None]:
        """`count` of max_concurrent_requests (one per generation an HTTP call fans out to, as
        upstream takes a permit per request); refused at once (429) when they are not all free,
        and with 503 once the router is shutting down."""
        if self.draining:
            raise ShuttingDown("new requests are refused")
        if self.in_flight + count > self.max_concurrent_requests:
            raise Overloaded()
        self.in_flight += count
        self.admitted += count
        try:
            yield
        finally:
            self.in_flight -= count

    async def validate(
        self, inputs: str, p: GenerateParameters, add_special_tokens: bool = True
    ) -> ValidRequest:
        """Upstream's checks in order; raises ValidationFailed with the literal message."""
        started = time.monotonic()
        try:
            check_sampling_parameters(p, self.limits)
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._pool, self.tokenizer.encode, inputs, add_special_tokens) \
                if inputs else []
            lengths = check_lengths(inputs, p, len(ids), self.limits.serving)
            if len(ids) > lengths[1]:  # truncated, as upstream: the shard gets only the text it will use
                inputs = await loop.run_in_executor(self._pool, self.tokenizer.decode, ids[-lengths[1]:])
            check_layer_skip(p.layer_skip)
            grammar = check_grammar(p, self.limits)
            await self._prepare_grammar(grammar)
        except ValidationError as err:
            raise ValidationFailed(str(err)) from err
        total_new = requested_new_tokens(p, lengths[1], self.limits.serving)
        request = build_valid_request(inputs, p, lengths, grammar[:2], add_special_tokens, total_new,
                                      tuple(ids[len(ids) - lengths[1]:]))
        self.metrics.request_validation_duration.observe(time.monotonic() - started)
        self.metrics.request_input_length.observe(request.input_length)
        self.metrics.request_max_new_tokens.observe(request.max_new_tokens)
        return request

    async def _prepare_grammar(self, grammar: GrammarCheck) -> None:
        """The shard compiles the grammar now (its limits first), off its step thread, so that the
        request's Prefill never waits for a compile; then the schema's meta-check, on a validation
        worker, unless the shard refused the grammar's size (the check is slow on large schemas).
        The meta-check's message wins over the shard's "does not compile", as upstream checks first."""
        if not grammar.grammar_type:
            return
        refusal = None
        if self.prepare_grammar is not None:
            refusal = await self.prepare_grammar(grammar.text, grammar.grammar_type)
        if grammar.schema is not None and (refusal is None or refusal.startswith(GRAMMAR_INVALID)):
            await asyncio.get_running_loop().run_in_executor(self._pool, check_json_schema, grammar.schema)
        if refusal is not None:
            raise ValidationError(refusal)

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The chat template's prompt, rendered on a validation worker (a TemplateError refuses it)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.tokenizer.apply_chat_template, messages, tools)

    async def tokenize(self, inputs: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        """/tokenize: on a validation worker, refused past max_input_tokens (upstream's message)."""
        self.admitted += 1
        spans = await asyncio.get_running_loop().run_in_executor(
            self._pool, self.tokenizer.spans, inputs, add_special_tokens)
        max_input = self.limits.serving.max_input_tokens
        if len(spans) > max_input:
            raise ValidationFailed(f"`inputs` must have less than {max_input} tokens. Given: {len(spans)}")
        return spans

    async def stream(self, request: ValidRequest, timing: Timing) -> AsyncGenerator[InferEvent, None]:
        """Queue a validated request and yield its events until its last token, chunk by chunk.

        Closing the iterator early (client gone) marks the request dropped; the batcher
        removes it at the next step.
        """
        chunk, generated, text = request, 0, ""
        while True:
            last: TokenEvent | None = None
            async with contextlib.aclosing(self._stream_chunk(chunk, timing)) as events:
                async for event in events:
                    if isinstance(event, TokenEvent) and event.end is not None:
                        last = event
                        break
                    yield event
            assert last is not None and last.end is not None, "_stream_chunk ends with the last token"
            generated += last.end.generated_tokens
            text += last.end.text
            end = dataclasses.replace(last.end, text=text, generated_tokens=generated)
            following = None
            if end.finish_reason == "length" and generated < request.max_total_new_tokens:
                following = await self._next_chunk(request, chunk, last.end.text, generated)
            if following is None:
                yield dataclasses.replace(last, end=end)
                return
            yield dataclasses.replace(last, end=None)
            chunk = following

    async def _next_chunk(self, request: ValidRequest, chunk: ValidRequest, text: str,
                          generated: int) -> ValidRequest | None:
        """The request's next chunk (prompt + its text so far), or None when it no longer fits."""
        inputs = chunk.inputs + text
        ids = await asyncio.get_running_loop().run_in_executor(
            self._pool, self.tokenizer.encode, inputs, request.add_special_tokens)
        serving = self.limits.serving
        input_length = min(len(ids), request.truncate)
        remaining = request.max_total_new_tokens - generated
        max_new = min(remaining, DEFAULT_GENERATION_LENGTH, serving.max_total_tokens - input_length)
        if max_new <= 0 or len(ids) > serving.max_input_tokens:
            return None
        return dataclasses.replace(chunk, inputs=inputs, input_length=input_length, max_new_tokens=max_new,
                                   input_ids=tuple(ids[len(ids) - input_length:]))

    async def _stream_chunk(self, request: ValidRequest, timing: Timing) -> AsyncGenerator[InferEvent, None]:
        """One shard request: its events until its last token."""
        entry = self.queue.append(request)
        self.metrics.queue_size.set(len(self.queue))
        finished = False
        try:
            while True:
                event = await entry.events.get()
                if isinstance(event, ErrorEvent):
                    finished = True
                    raise error_from_event(event.kind, event.message)
                if not timing.first_batched:
                    timing.first_batched = entry.batched_at or time.monotonic()
                # Set before the yield: a consumer may stop iterating at the last token.
                finished = isinstance(event, TokenEvent) and event.end is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:  # the client went away: counted once, here, wherever it was
                entry.dropped = True
                self.metrics.request_failure.labels(err="dropped").inc()

    async def complete(
        self, inputs: str, p: GenerateParameters, timing: Timing, add_special_tokens: bool
    ) -> FinishedGeneration:
        """Validate one prompt and run it to completion."""
        request = await self.validate(inputs, p, add_special_tokens)
        timing.validated = time.monotonic()
        return await self.generate(request, timing)

    async def generate(self, request: ValidRequest, timing: Timing) -> FinishedGeneration:
        """Run a request to completion and collect its tokens."""
        tokens: list[Token] = []
        tops: list[list[Token]] = []
        prefill: list[Token] = []
        async for event in self.stream(request, timing):
            if isinstance(event, PrefillEvent):
                prefill = event.tokens
            elif isinstance(event, TokenEvent):
                tokens.append(event.token)
                if event.top_tokens:
                    tops.append(event.top_tokens)
                if event.end is not None:
                    now = time.monotonic()
                    return FinishedGeneration(
                        request=request, generated=event.end, tokens=tokens, top_tokens=tops,
                        prefill=prefill, layer_skip=event.layer_skip,
                        queued_s=timing.first_batched - timing.validated,
                        inference_s=now - timing.first_batched,
                    )
        raise IncompleteGeneration()
