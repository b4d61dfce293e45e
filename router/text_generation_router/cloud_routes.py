"""Cloud platforms' entry points: SageMaker's POST /invocations and Vertex AI's POST /vertex.

/invocations takes a generate, chat or completions body, tried in that order as upstream's
untagged enum does, and answers as that route would. /vertex takes `{"instances": [...]}` of
generate (`{inputs, parameters?}`) or chat instances and answers `{"predictions": [text...]}`;
generate instances always sample and keep only max_new_tokens and seed, as upstream's do.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError

from text_generation_router.chat import chat_completion, plan_chat
from text_generation_router.completions import completion
from text_generation_router.connection import unless_disconnected
from text_generation_router.errors import InferError
from text_generation_router.generate import generate_response, stream_response
from text_generation_router.http_body import TYPE_PREFIX, BodyError, read_json, read_json_value
from text_generation_router.infer import Timing, run_together
from text_generation_router.openai_shapes import generate_one
from text_generation_router.openapi import body_route, json_ok, json_or_sse_ok
from text_generation_router.schemas import (
    ChatRequest,
    CompatGenerateRequest,
    CompletionRequest,
    GenerateParameters,
)
from text_generation_router.state import AppState
from text_generation_router.wire_types import Str


class GenerateVertexInstance(BaseModel):
    inputs: Str
    parameters: GenerateParameters | None = None


class VertexRequest(BaseModel):
    instances: list[GenerateVertexInstance | ChatRequest]


SAGEMAKER_BODIES: list[type[BaseModel]] = [CompatGenerateRequest, ChatRequest, CompletionRequest]


def sagemaker_body(data: Any) -> BaseModel:
    """The first of generate, chat, completions that the body is (serde's untagged enum)."""
    for model in SAGEMAKER_BODIES:
        try:
            return model.model_validate(data)
        except PydanticError:
            continue
    raise BodyError(422, f"{TYPE_PREFIX}: data did not match any variant of untagged enum SagemakerRequest")


async def sagemaker(state: AppState, body: BaseModel) -> Response:
    if isinstance(body, CompatGenerateRequest):
        if body.stream:
            return stream_response(state, body, default_full_text=True)
        return await generate_response(state, body, default_full_text=True, as_list=True)
    if isinstance(body, ChatRequest):
        return await chat_completion(state, body)
    assert isinstance(body, CompletionRequest)
    return await completion(state, body)


async def vertex(state: AppState, req: VertexRequest) -> JSONResponse:
    state.metrics.request_count.inc()
    if not req.instances:
        return JSONResponse({"error": "Input validation error", "error_type": "Input validation error"}, 422)
    requests: list[tuple[str, GenerateParameters, bool]] = []
    for instance in req.instances:
        if isinstance(instance, GenerateVertexInstance):
            p = instance.parameters or GenerateParameters()
            params = GenerateParameters(do_sample=True, max_new_tokens=p.max_new_tokens, seed=p.seed, details=True,
                                        decoder_input_details=True)
            requests.append((instance.inputs, params, True))
        else:
            plan = plan_chat(instance, state)  # template and tool errors answer as themselves
            requests.append((plan.prompt, plan.params, False))
    try:
        async with state.infer.slot():
            generations = await run_together([generate_one(state, prompt, params, Timing(), special)
                                               for prompt, params, special in requests])
    except InferError as err:
        state.metrics.request_failure.labels(err=err.metric_label).inc()
        return JSONResponse({"error": "Incomplete generation", "error_type": "Incomplete generation"}, 500)
    state.metrics.request_success.inc()
    return JSONResponse({"predictions": [g.generated.text for g in generations]})


def register_cloud_routes(app: FastAPI, state: AppState) -> None:
    limit = state.config.payload_limit

    @app.post("/invocations", openapi_extra=body_route(CompatGenerateRequest, json_or_sse_ok(
        "As /, /v1/chat/completions or /v1/completions, whichever body it is")))
    async def invocations(request: Request) -> Response:
        body = sagemaker_body(await read_json_value(request, limit))
        return await unless_disconnected(request, sagemaker(state, body))

    @app.post("/vertex", openapi_extra=body_route(VertexRequest, json_ok("{predictions: [generated text]}")))
    async def vertex_route(request: Request) -> Response:
        body = await read_json(request, VertexRequest, limit)
        return await unless_disconnected(request, vertex(state, body))


__all__ = ["register_cloud_routes"]
