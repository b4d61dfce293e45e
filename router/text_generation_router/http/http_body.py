"""Reading JSON bodies the way upstream's axum/serde extractor answers (docs/tgi-interface.md §2.8 notes).

415 without a JSON content type, 413 over the payload limit (counted while reading, so a body
without Content-Length cannot grow past it), 400 for text that is not JSON (a syntax error,
bytes that are not UTF-8, a lone UTF-16 surrogate, nesting deeper than serde's 128 levels, an
integer of thousands of digits) and 422 for a value that does not fit its field's type
(`NaN`/`Infinity` included, which JSON does not have); all with plain-text bodies naming the
field, not the JSON error shape.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError
from pydantic_core import ErrorDetails
from starlette.requests import ClientDisconnect

from text_generation_router.engine.wire_types import describe

M = TypeVar("M", bound=BaseModel)
MAX_DEPTH = 128  # serde_json's recursion limit
PARSE_PREFIX = "Failed to parse the request body as JSON"
TYPE_PREFIX = "Failed to deserialize the JSON body into the target type"


class BodyError(Exception):
    """A body that never reaches validation; answered in plain text."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class _NonFinite:
    """`NaN`, `Infinity` or `-Infinity` in the body: Python's json accepts them, JSON does not."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


async def read_body(request: Request, payload_limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it passes the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > payload_limit:
        raise BodyError(413, "Failed to buffer the request body: length limit exceeded")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > payload_limit:
                raise BodyError(413, "Failed to buffer the request body: length limit exceeded")
            chunks.append(chunk)
    except ClientDisconnect as err:
        raise BodyError(400, "Failed to buffer the request body: the client disconnected") from err
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """Strict JSON: UTF-8 only, no NaN/Infinity, no lone surrogates, at most 128 levels."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BodyError(400, f"{PARSE_PREFIX}: invalid UTF-8 at byte {err.start}") from err
    try:
        data = json.loads(text, parse_constant=_NonFinite)
    except json.JSONDecodeError as err:
        raise BodyError(400, f"{PARSE_PREFIX}: {err}") from err
    except RecursionError as err:
        raise BodyError(400, f"{PARSE_PREFIX}: recursion limit exceeded") from err
    except ValueError as err:  # an integer past Python's digit limit
        raise BodyError(400, f"{PARSE_PREFIX}: number out of range ({err})") from err
    _check_values(data)
    return data


def _check_values(data: Any) -> None:
    """Walk the parsed body once, without recursion, refusing what serde would not decode."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        where = path or "body"
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, _NonFinite):
            raise BodyError(422, f"{TYPE_PREFIX}: {where}: `{value.literal}` is not a JSON number")
        elif isinstance(value, float) and not math.isfinite(value):
            raise BodyError(422, f"{TYPE_PREFIX}: {where}: number out of range")
        elif isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise BodyError(400, f"{PARSE_PREFIX}: recursion limit exceeded")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, f"{where} (a key)")
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        raise BodyError(
            400, f"{PARSE_PREFIX}: {where}: lone surrogate \\u{ord(bad):04x} is not valid Unicode"
        ) from err


def _json_path(data: Any, error: ErrorDetails) -> str:
    """The error's location as a path into the body ("" for the top level); pydantic's
    union-member tags drop out because they index nothing in the data, and a missing field is
    named by the message, as serde does."""
    loc = tuple(error.get("loc", ()))
    parts: list[str] = []
    current = data
    for item in loc:
        in_map = isinstance(current, dict) and isinstance(item, str) and item in current
        in_list = isinstance(current, list) and isinstance(item, int) and 0 <= item < len(current)
        if in_map or in_list:
            current = current[item]
            parts.append(str(item))
    return ".".join(parts)


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind in ("wire_type", "wire_value"):
        return error["msg"]
    if kind == "missing":
        return f"missing field `{error['loc'][-1]}`"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"invalid type: {describe(error.get('input'))}, expected a map"
    if kind == "list_type":
        return f"invalid type: {describe(error.get('input'))}, expected a sequence"
    if kind == "value_error":
        return str(error.get("ctx", {}).get("error", error["msg"]))
    return error["msg"]


def check_model(data: Any, model: type[M]) -> M:
    """Type-check a parsed body, or raise BodyError(422) naming the field."""
    try:
        return model.model_validate(data)
    except PydanticError as err:
        errors = err.errors()
        # The deepest error is the most specific one (e.g. inside a union's matching branch).
        worst = max(errors, key=lambda e: len(e.get("loc", ())))
        where = _json_path(data, worst)
        located = f"{where}: " if where else ""
        raise BodyError(422, f"{TYPE_PREFIX}: {located}{_message(worst)}") from err


async def read_json_value(request: Request, payload_limit: int) -> Any:
    """The parsed JSON body (not yet type-checked), or raise BodyError."""
    content_type = request.headers.get("content-type", "")
    mime = content_type.split(";")[0].strip().lower()
    if not (mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))):
        raise BodyError(415, "Expected request with `Content-Type: application/json`")
    return parse_json(await read_body(request, payload_limit))


async def read_json(request: Request, model: type[M], payload_limit: int) -> M:
    """Parse and type-check a request body, or raise BodyError."""
    return check_model(await read_json_value(request, payload_limit), model)
