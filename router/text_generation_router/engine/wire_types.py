"""Strict JSON field types that mirror upstream's Rust wire types (u32, u64, i32, f32, bool).

Upstream's router deserializes bodies with serde, so `"20"` is not an integer, `true` is not a
number, `-1` is not a u32 and 2^64 is not a u64: the body is refused (422) before any value
check runs. These annotated types give pydantic the same rules, with serde's wording, so that
every value that passes them also fits the protobuf field it ends up in. The JSON Schema each
one publishes (OpenAPI document) states the same bounds.
"""

from __future__ import annotations

import json
import math
import struct
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
F32_MAX = 3.4028234663852886e38  # the largest finite float32


def describe(value: Any) -> str:
    """A JSON value the way serde names it in its errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"string {json.dumps(shown, ensure_ascii=False)}"
    if isinstance(value, list):
        return "a sequence"
    if isinstance(value, dict):
        return "a map"
    return type(value).__name__


def _type_error(value: Any, expected: str) -> PydanticCustomError:
    return PydanticCustomError(
        "wire_type", "invalid type: {got}, expected {expected}",
        {"got": describe(value), "expected": expected},
    )


def _integer(kind: str, low: int, high: int, nullable: bool) -> Any:
    def check(value: Any) -> int | None:
        if value is None and nullable:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise _type_error(value, kind)
        if not low <= value <= high:
            raise PydanticCustomError(
                "wire_value", "invalid value: integer `{value}`, expected {kind}",
                {"value": value, "kind": kind},
            )
        return value

    schema: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": high,
                              "format": "int32" if kind in ("u32", "i32") else "int64"}
    if nullable:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return Annotated[int | None if nullable else int, PlainValidator(check), WithJsonSchema(schema)]


def _f32(nullable: bool) -> Any:
    def check(value: Any) -> float | None:
        if value is None and nullable:
            return None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _type_error(value, "f32")
        # Non-finite numbers are refused when the body is parsed; this bounds the magnitude.
        if not math.isfinite(float(value)) or abs(float(value)) > F32_MAX:
            raise PydanticCustomError(
                "wire_value", "invalid value: {got}, expected a finite f32", {"got": describe(value)},
            )
        # The value as f32, as serde reads it and the shard receives it: 1e-50 is 0.0, so the
        # checks that follow (temperature > 0, ...) see what the shard would.
        number: float = struct.unpack("f", struct.pack("f", float(value)))[0]
        return number

    schema: dict[str, Any] = {"type": "number", "format": "float", "minimum": -F32_MAX,
                              "maximum": F32_MAX}
    if nullable:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return Annotated[float | None if nullable else float, PlainValidator(check), WithJsonSchema(schema)]


def _boolean(nullable: bool) -> Any:
    def check(value: Any) -> bool | None:
        if value is None and nullable:
            return None
        if not isinstance(value, bool):
            raise _type_error(value, "a boolean")
        return value

    schema: dict[str, Any] = {"type": "boolean"}
    if nullable:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return Annotated[bool | None if nullable else bool, PlainValidator(check), WithJsonSchema(schema)]


def _string(nullable: bool) -> Any:
    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            raise _type_error(value, "a string")
        return value

    schema: dict[str, Any] = {"type": "string"}
    if nullable:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return Annotated[str | None if nullable else str, PlainValidator(check), WithJsonSchema(schema)]


# mypy sees the plain Python types; pydantic sees the checks above.
if TYPE_CHECKING:
    U32 = int
    OptU32 = int | None
    OptU64 = int | None
    OptI32 = int | None
    OptF32 = float | None
    Bool = bool
    OptBool = bool | None
    Str = str
    OptStr = str | None
else:
    U32 = _integer("u32", 0, U32_MAX, False)
    OptU32 = _integer("u32", 0, U32_MAX, True)
    OptU64 = _integer("u64", 0, U64_MAX, True)
    OptI32 = _integer("i32", I32_MIN, I32_MAX, True)
    OptF32 = _f32(True)
    Bool = _boolean(False)
    OptBool = _boolean(True)
    Str = _string(False)
    OptStr = _string(True)
