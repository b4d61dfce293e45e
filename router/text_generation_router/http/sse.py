"""Server-sent events framing as upstream's writer (axum) frames it: `data: <compact json>\\n\\n`,
one space after the colon. huggingface_hub's chat stream recognises only `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

KEEP_ALIVE = b":\n\n"
KEEP_ALIVE_S = 15.0
DONE = b"data: [DONE]\n\n"


def _clean(value: Any) -> Any:
    """NaN logprobs (first prompt token) become null, as upstream's JSON does."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def dumps(payload: Any) -> str:
    """Compact JSON with NaN as null."""
    return json.dumps(_clean(payload), separators=(",", ":"), ensure_ascii=False)


def event(payload: Any) -> bytes:
    """One SSE event."""
    return f"data: {dumps(payload)}\n\n".encode()


class NanSafeJSONResponse(JSONResponse):
    """JSONResponse whose NaN logprobs render as null (upstream's serde does the same)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode()


async def with_keep_alive(
    events: AsyncIterator[bytes], interval_s: float = KEEP_ALIVE_S
) -> AsyncIterator[bytes]:
    """Pass events through, sending a `:` comment whenever none came for interval_s.

    The inner iterator is advanced in its own task so a slow token does not block the
    comment; when the client leaves, that task is cancelled, which runs the inner
    generator's cleanup (the request is then dropped at the batcher's next step).
    """
    iterator = aiter(events)
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEP_ALIVE
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
