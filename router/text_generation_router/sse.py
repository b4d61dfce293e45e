"""Server-sent events framing of spec §2.4: `data:<compact json>\\n\\n`, no space."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

KEEP_ALIVE = b":\n\n"
DONE = b"data:[DONE]\n\n"


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
    return f"data:{dumps(payload)}\n\n".encode()


class NanSafeJSONResponse(JSONResponse):
    """JSONResponse whose NaN logprobs render as null (upstream's serde does the same)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode()
