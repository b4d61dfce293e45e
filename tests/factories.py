"""Factories for generate.v3 requests, and small drivers that run requests to completion: over
gRPC against a shard (`run_to_completion`) and in-process on a `CausalLM` (`decode_in_process`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from text_generation_server.pb import generate_pb2, generate_pb2_grpc

if TYPE_CHECKING:
    from text_generation_server.engine.batch import CausalLMBatch
    from text_generation_server.engine.causal_lm import CausalLM, FinishedText, LayerSkipReport

# The guided-generation tests' grammars: a JSON schema and a regex.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"

CHAT_FRANCE = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


def make_request(request_id: int, inputs: str, max_new_tokens: int = 8, *, stop: tuple[str, ...] = (),
                 ignore_eos: bool = False, top_n_tokens: int = 0, prefill_logprobs: bool = False,
                 truncate: int = 0, **params: object) -> generate_pb2.Request:
    base: dict[str, object] = {"temperature": 1.0, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0}
    base.update(params)
    return generate_pb2.Request(
        id=request_id, inputs=inputs, truncate=truncate,
        input_chunks=generate_pb2.Input(chunks=[generate_pb2.InputChunk(text=inputs)]),
        parameters=generate_pb2.NextTokenChooserParameters(**base),  # type: ignore[arg-type]
        stopping_parameters=generate_pb2.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, stop_sequences=list(stop), ignore_eos_token=ignore_eos),
        top_n_tokens=top_n_tokens, prefill_logprobs=prefill_logprobs, add_special_tokens=True,
    )


def make_batch(batch_id: int, requests: list[generate_pb2.Request]) -> generate_pb2.Batch:
    return generate_pb2.Batch(id=batch_id, requests=requests, size=len(requests),
                              max_tokens=sum(r.stopping_parameters.max_new_tokens for r in requests))


@dataclass
class Outcome:
    """Everything a request produced, collected across steps."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    top_tokens: list[generate_pb2.Tokens] = field(default_factory=list)
    prefill: generate_pb2.Tokens | None = None
    final: generate_pb2.GeneratedText | None = None


def collect(outcomes: dict[int, Outcome], generations: list[generate_pb2.Generation]) -> None:
    for g in generations:
        o = outcomes.setdefault(g.request_id, Outcome())
        assert len(g.tokens.ids) == len(g.tokens.logprobs) == len(g.tokens.texts) == len(g.tokens.is_special)
        o.token_ids.extend(g.tokens.ids)
        o.logprobs.extend(g.tokens.logprobs)
        o.texts.extend(g.tokens.texts)
        o.top_tokens.extend(g.top_tokens)
        if g.HasField("prefill_tokens") and g.prefill_tokens.ids:
            o.prefill = g.prefill_tokens
        if g.HasField("generated_text"):
            o.final = g.generated_text


def run_to_completion(stub: generate_pb2_grpc.TextGenerationServiceStub, batch_id: int,
                      requests: list[generate_pb2.Request]) -> dict[int, Outcome]:
    """Prefill, then Decode (filtering finished requests as the router does) until all finish."""
    outcomes: dict[int, Outcome] = {}
    response = stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(batch_id, requests)))
    collect(outcomes, list(response.generations))
    cached = response.batch if response.HasField("batch") else None
    while cached is not None:
        live = [rid for rid in cached.request_ids if outcomes[rid].final is None]
        if len(live) != len(cached.request_ids):
            cached = stub.FilterBatch(generate_pb2.FilterBatchRequest(batch_id=cached.id, request_ids=live)).batch
        decoded = stub.Decode(generate_pb2.DecodeRequest(batches=[cached]))
        collect(outcomes, list(decoded.generations))
        cached = decoded.batch if decoded.HasField("batch") else None
    return outcomes


@dataclass
class Decoded:
    """What each request of an in-process decode produced, by request id."""

    tokens: dict[int, list[int]]
    logprobs: dict[int, list[float]]
    last: CausalLMBatch  # the last batch that ran
    finals: dict[int, FinishedText] = field(default_factory=dict)
    reports: dict[int, LayerSkipReport] = field(default_factory=dict)  # each request's last report
    errors: dict[int, str] = field(default_factory=dict)  # the requests that failed alone


def decode_in_process(lm: CausalLM, batch: CausalLMBatch) -> Decoded:
    """`lm.generate_token` from prefill until every request of `batch` has finished."""
    ids = [state.id for state in batch.requests]
    out = Decoded({i: [] for i in ids}, {i: [] for i in ids}, batch)
    current: CausalLMBatch | None = batch
    while current is not None:
        out.last = current
        generations, current, _ = lm.generate_token(current)
        for g in generations:
            out.tokens[g.request_id].extend(g.tokens.ids)
            out.logprobs[g.request_id].extend(g.tokens.logprobs)
            if g.generated_text is not None:
                out.finals[g.request_id] = g.generated_text
            if g.layer_skip is not None:
                out.reports[g.request_id] = g.layer_skip
            if g.error is not None:
                out.errors[g.request_id] = g.error
    return out
