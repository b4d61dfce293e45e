"""The FastAPI application: routes, auth, CORS, error bodies (docs/tgi-interface.md §2)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from text_generation_router import __version__
from text_generation_router.engine.batcher import Batcher
from text_generation_router.engine.client import ShardError
from text_generation_router.engine.dispatch import health_batch
from text_generation_router.engine.errors import InferError
from text_generation_router.engine.memory import trim_after_bursts
from text_generation_router.engine.metrics import render
from text_generation_router.engine.schemas import (
    ChatRequest,
    CompatGenerateRequest,
    CompletionRequest,
    GenerateRequest,
)
from text_generation_router.http import openapi
from text_generation_router.http.chat import register_openai_routes
from text_generation_router.http.cloud_routes import VertexRequest, register_cloud_routes
from text_generation_router.http.connection import ClientGone, unless_disconnected
from text_generation_router.http.generate import generate_response, stream_response
from text_generation_router.http.http_body import BodyError, read_json
from text_generation_router.http.openapi import body_route, json_ok, json_or_sse_ok, sse_ok
from text_generation_router.http.state import AppState

PROTECTED = {"/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions",
             "/tokenize", "/invocations", "/vertex"}


def build_app(state: AppState, batcher: Batcher) -> FastAPI:
    """Create the app; the batcher runs for the app's lifetime."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(batcher.run()), asyncio.create_task(trim_after_bursts(state.infer))]
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(
        title="Text Generation Inference", version=__version__, lifespan=lifespan,
        docs_url="/docs", openapi_url="/api-doc/openapi.json", redoc_url=None,
    )
    app.state.tgi = state
    origins = list(state.config.cors_allow_origin) or ["*"]
    app.add_middleware(
        CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
        allow_headers=["content-type"],
    )
    _install_auth(app, state)
    _install_errors(app)
    _register_native_routes(app, state)
    _register_info_routes(app, state)
    register_openai_routes(app, state)
    register_cloud_routes(app, state)
    openapi.install(app, [GenerateRequest, CompatGenerateRequest, ChatRequest, CompletionRequest, VertexRequest])
    return app


def _install_auth(app: FastAPI, state: AppState) -> None:
    key = state.config.api_key
    if not key:
        return
    expected = f"bearer {key}".lower()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        protected = request.method == "POST" and request.url.path in PROTECTED
        if protected and request.headers.get("authorization", "").lower() != expected:
            return Response(status_code=401)
        return await call_next(request)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(InferError)
    async def infer_error(_: Request, err: InferError) -> JSONResponse:
        return JSONResponse({"error": err.message, "error_type": err.error_type}, err.status)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, err: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(BodyError)
    async def body_error(_: Request, err: BodyError) -> Response:
        return Response(err.text, status_code=err.status, media_type="text/plain; charset=utf-8")


def _register_native_routes(app: FastAPI, state: AppState) -> None:
    limit = state.config.payload_limit

    @app.post("/generate", openapi_extra=body_route(GenerateRequest, json_ok("GenerateResponse")))
    async def generate(request: Request) -> Response:
        req = await read_json(request, GenerateRequest, limit)
        return await generate_response(state, request, req, default_full_text=False, as_list=False)

    @app.post("/generate_stream", openapi_extra=body_route(GenerateRequest, sse_ok("StreamResponse events")))
    async def generate_stream(request: Request) -> Response:
        req = await read_json(request, GenerateRequest, limit)
        return stream_response(state, request, req, default_full_text=False)

    @app.post("/", openapi_extra=body_route(
        CompatGenerateRequest, json_or_sse_ok("[GenerateResponse], or StreamResponse events")))
    async def compat_generate(request: Request) -> Response:
        req = await read_json(request, CompatGenerateRequest, limit)
        # return_full_text defaults to true for an unknown pipeline tag (docs/tgi-interface.md §8 gotcha 1).
        if req.stream:
            return stream_response(state, request, req, default_full_text=True)
        return await generate_response(state, request, req, default_full_text=True, as_list=True)

    @app.post("/tokenize", openapi_extra=body_route(
        GenerateRequest, json_ok("Tokens with their offsets", {"type": "array", "items": {"type": "object"}})))
    async def tokenize(request: Request) -> Response:
        req = await read_json(request, GenerateRequest, limit)
        spans = await unless_disconnected(request, state.infer.tokenize(req.inputs))
        return JSONResponse([{"id": s.id, "text": s.text, "start": s.start, "stop": s.stop} for s in spans])


async def probe_health(state: AppState) -> bool:
    """Health RPC while generation works; after a failure a real one-token Prefill."""
    try:
        if state.health.generation_ok:
            await state.client.health()
            return True
        await state.client.prefill(health_batch())
        state.health.generation_ok = True
        return True
    except ShardError:
        return False


def _register_info_routes(app: FastAPI, state: AppState) -> None:
    async def health() -> Response:
        if await probe_health(state):
            return Response(status_code=200)
        return JSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, 503)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET"])
    app.add_api_route("/", health, methods=["GET"])

    @app.get("/info")
    async def info() -> JSONResponse:
        c = state.config
        return JSONResponse({
            "model_id": state.model_id, "model_sha": None, "model_pipeline_tag": None,
            "max_concurrent_requests": c.max_concurrent_requests, "max_best_of": c.max_best_of,
            "max_stop_sequences": c.max_stop_sequences,
            "max_input_tokens": state.limits.max_input_tokens,
            "max_total_tokens": state.limits.max_total_tokens,
            "validation_workers": c.validation_workers,
            "max_client_batch_size": c.max_client_batch_size,
            "router": "text-generation-router", "version": __version__, "sha": None,
            "docker_label": None,
        })

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(state.metrics), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_id, "object": "model", "created": 0, "owned_by": state.model_id}
        ]})
