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

from text_generation_router.engine.errors import InferError, Overloaded
from text_generation_router.engine.infer import Timing, run_together
from text_generation_router.engine.schemas import (
    ChatRequest,
    CompatGenerateRequest,
    CompletionRequest,
    GenerateParameters,
)
from text_generation_router.engine.wire_types import Str
from text_generation_router.http.chat import chat_completion, plan_chat
from text_generation_router.http.completions import completion
from text_generation_router.http.generate import generate_response, stream_response
from text_generation_router.http.http_body import TYPE_PREFIX, BodyError, read_json, read_json_value
from text_generation_router.http.lifecycle import Lifecycle
from text_generation_router.http.openapi import body_route, json_ok, json_or_sse_ok
from text_generation_router.http.state import AppState


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


class VertexEmpty(InferError):
    """`instances` is empty: upstream's 422, with its message as error_type."""

    status = 422
    error_type = "Input validation error"
    metric_label = "validation"

    def __init__(self) -> None:
        super().__init__("Input validation error")


class VertexTooLarge(InferError):
    """More instances than --max-client-batch-size (each is a generation and takes a slot)."""

    status = 422
    error_type = "validation"
    metric_label = "validation"

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"Input validation error: {count} instances; the maximum allowed batch size "
                         f"(--max-client-batch-size) is {limit}")


class VertexFailed(InferError):
    """Any failure of a /vertex instance but overload (429), as upstream answers it."""

    status = 500
    error_type = "Incomplete generation"

    def __init__(self) -> None:
        super().__init__("Incomplete generation")


async def sagemaker(state: AppState, http: Request, body: BaseModel) -> Response:
    if isinstance(body, CompatGenerateRequest):
        if body.stream:
            return stream_response(state, http, body, default_full_text=True)
        return await generate_response(state, http, body, default_full_text=True, as_list=True)
    if isinstance(body, ChatRequest):
        return await chat_completion(state, http, body)
    assert isinstance(body, CompletionRequest)
    return await completion(state, http, body)


async def vertex_prompts(state: AppState, req: VertexRequest) -> list[tuple[str, GenerateParameters, bool]]:
    """(prompt, parameters, add_special_tokens) of each instance; template and tool errors
    answer as themselves."""
    if not req.instances:
        raise VertexEmpty()
    if len(req.instances) > state.config.max_client_batch_size:
        raise VertexTooLarge(len(req.instances), state.config.max_client_batch_size)
    prompts: list[tuple[str, GenerateParameters, bool]] = []
    for instance in req.instances:
        if isinstance(instance, GenerateVertexInstance):
            p = instance.parameters or GenerateParameters()
            params = GenerateParameters(do_sample=True, max_new_tokens=p.max_new_tokens, seed=p.seed, details=True,
                                        decoder_input_details=True)
            prompts.append((instance.inputs, params, True))
        else:
            plan = await plan_chat(instance, state)
            prompts.append((plan.prompt, plan.params, False))
    return prompts


async def vertex(state: AppState, http: Request, req: VertexRequest) -> JSONResponse:
    call = Lifecycle.start(state, http)
    prompts = await call.prepare_async(lambda: vertex_prompts(state, req))
    generations = await call.answer(
        lambda: run_together([state.infer.complete(prompt, params, Timing(), special)
                              for prompt, params, special in prompts]),
        fail=lambda err: err if isinstance(err, Overloaded) else VertexFailed(), slots=len(prompts),
    )
    return JSONResponse({"predictions": [g.generated.text for g in generations]})


def register_cloud_routes(app: FastAPI, state: AppState) -> None:
    limit = state.config.payload_limit

    @app.post("/invocations", openapi_extra=body_route(CompatGenerateRequest, json_or_sse_ok(
        "As /, /v1/chat/completions or /v1/completions, whichever body it is")))
    async def invocations(request: Request) -> Response:
        body = sagemaker_body(await read_json_value(request, limit))
        return await sagemaker(state, request, body)

    @app.post("/vertex", openapi_extra=body_route(VertexRequest, json_ok("{predictions: [generated text]}")))
    async def vertex_route(request: Request) -> Response:
        body = await read_json(request, VertexRequest, limit)
        return await vertex(state, request, body)


__all__ = ["register_cloud_routes"]
