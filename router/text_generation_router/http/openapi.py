"""The OpenAPI document at /api-doc/openapi.json: request bodies, responses and errors.

The routes read their bodies themselves (http_body.py answers 400/413/415/422 as upstream
does), so FastAPI cannot infer them; each route declares its body model and answers here.
Body schemas live once in `components/schemas` and are referenced from there; the error
answers are documented with their real content types (plain text for body errors, JSON for
validation and generation errors, SSE for streams, text for /metrics).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"
JSON = "application/json"
SSE = "text/event-stream"
TEXT = "text/plain"

_ERROR_SCHEMA = {
    "type": "object", "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
}


def _content(*types: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {t: {"schema": schema if schema is not None else {"type": "string"}} for t in types}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}


def _body_error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _content(TEXT)}


def body_route(model: type[BaseModel], ok: dict[str, Any]) -> dict[str, Any]:
    """openapi_extra of a POST route reading `model`, answering `ok` (the 200 response)."""
    return {
        "requestBody": {"required": True, "content": {JSON: {"schema": {"$ref": REF.format(model=model.__name__)}}}},
        "responses": {
            "200": ok,
            "400": _body_error("The body is not JSON (syntax, UTF-8, lone surrogate, nesting)"),
            "401": {"description": "Missing or wrong API key (empty body)"},
            "413": _body_error("The body is larger than --payload-limit"),
            "415": _body_error("The content type is not JSON"),
            "422": {"description": "A field does not fit its type (plain text), or a value is refused "
                                   "by validation (JSON error)",
                    "content": {TEXT: {"schema": {"type": "string"}},
                                JSON: {"schema": {"$ref": REF.format(model="ErrorResponse")}}}},
            "424": _error("Generation failed in the shard"),
            "429": _error("More than --max-concurrent-requests requests are in flight"),
            "503": _error("The router is shutting down"),
        },
    }


def json_ok(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema or {"type": "object"}}}}


def sse_ok(description: str) -> dict[str, Any]:
    return {"description": description, "content": _content(SSE)}


def json_or_sse_ok(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {JSON: {"schema": {"type": ["object", "array"]}}, SSE: {"schema": {"type": "string"}}}}


_HEALTH = {"200": {"description": "Healthy (empty body)"}, "503": _error("Unhealthy")}
INFO_ROUTES: dict[tuple[str, str], dict[str, Any]] = {
    ("/health", "get"): _HEALTH, ("/ping", "get"): _HEALTH, ("/", "get"): _HEALTH,
    ("/metrics", "get"): {"200": {"description": "Prometheus text exposition", "content": _content(TEXT)}},
}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve a document whose body schemas are components, referenced with valid refs."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs.get("$defs", {}))
            schemas["ErrorResponse"] = _ERROR_SCHEMA
            for (path, method), responses in INFO_ROUTES.items():
                doc["paths"][path][method]["responses"] = responses
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
