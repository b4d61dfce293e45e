"""Reading JSON bodies the way upstream's axum extractor answers (spec §2.8 notes).

415 without a JSON content type, 413 over the payload limit, 400 for a syntax error and
422 for a type mismatch; all with plain-text bodies, not the JSON error shape.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError

M = TypeVar("M", bound=BaseModel)


class BodyError(Exception):
    """A body that never reaches validation; answered in plain text."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


async def read_json(request: Request, model: type[M], payload_limit: int) -> M:
    """Parse and type-check a request body, or raise BodyError."""
    content_type = request.headers.get("content-type", "")
    mime = content_type.split(";")[0].strip().lower()
    if not (mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))):
        raise BodyError(415, "Expected request with `Content-Type: application/json`")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > payload_limit:
        raise BodyError(413, "Failed to buffer the request body: length limit exceeded")
    raw = await request.body()
    if len(raw) > payload_limit:
        raise BodyError(413, "Failed to buffer the request body: length limit exceeded")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BodyError(400, f"Failed to parse the request body as JSON: {err}") from err
    try:
        return model.model_validate(data)
    except PydanticError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise BodyError(
            422,
            f"Failed to deserialize the JSON body into the target type: {where}: {first.get('msg')}",
        ) from err
