"""Per-request refusal in the shard (the `per_request_errors` extension), on the real default model:
a batch with bad requests prefills the good ones, which produce their solo tokens. A request
failing mid-decode is checked in-process by tests/server/test_request_isolation_causal_lm.py."""

from __future__ import annotations

import grpc
import pytest

from text_generation_server.pb import generate_pb2, generate_pb2_grpc

from factories import Outcome, collect, make_batch, make_request, run_to_completion

Stub = generate_pb2_grpc.TextGenerationServiceStub
PROMPT = "1, 2, 3, 4, 5,"


def _bad_requests() -> dict[int, tuple[generate_pb2.Request, str]]:
    """Each refusal class the shard checks per request, with a piece of its message."""
    cases = {
        901: (make_request(901, "", 4), "empty input"),
        902: (make_request(902, "hello", 4, grammar="[0-9]+"), "a grammar was sent with GRAMMAR_TYPE_NONE"),
        903: (make_request(903, "hello", 4, grammar='{"type": "nonsense"}',
                           grammar_type=generate_pb2.GRAMMAR_TYPE_JSON),
              "grammar is not valid: json grammar does not compile"),
        904: (make_request(904, "hello", 4, grammar="[0-9", grammar_type=generate_pb2.GRAMMAR_TYPE_REGEX),
              "grammar is not valid: regex grammar does not compile"),
        905: (make_request(905, "hello", 0), "max_new_tokens must be strictly positive"),
        906: (make_request(906, "hello", 4, temperature=float("nan")), "temperature must be a finite number"),
        907: (make_request(907, "hello", 4, repetition_penalty=float("inf")), "repetition_penalty must be a finite"),
    }
    bad_mode = make_request(908, "hello", 4)
    bad_mode.layer_skip_mode = "fast"
    cases[908] = (bad_mode, "layer_skip mode 'fast' is not one of")
    return cases


def _run_isolated(shard: Stub, batch_id: int, requests: list[generate_pb2.Request]) -> tuple[
        dict[int, Outcome], dict[int, str]]:
    outcomes: dict[int, Outcome] = {}
    answer = shard.Prefill(generate_pb2.PrefillRequest(batch=make_batch(batch_id, requests), per_request_errors=True))
    refused = {e.request_id: e.message for e in answer.request_errors}
    collect(outcomes, list(answer.generations))
    cached = answer.batch if answer.HasField("batch") else None
    if cached is not None:
        assert not set(cached.request_ids) & set(refused), "a refused request stayed in the batch"
    while cached is not None:
        live = [rid for rid in cached.request_ids if outcomes[rid].final is None]
        if len(live) != len(cached.request_ids):
            cached = shard.FilterBatch(generate_pb2.FilterBatchRequest(batch_id=cached.id, request_ids=live)).batch
        step = shard.Decode(generate_pb2.DecodeRequest(batches=[cached], per_request_errors=True))
        assert not step.request_errors
        collect(outcomes, list(step.generations))
        cached = step.batch if step.HasField("batch") else None
    return outcomes, refused


def test_bad_requests_are_refused_alone_and_the_rest_is_prefilled(shard: Stub) -> None:
    solo = run_to_completion(shard, 950, [make_request(950, PROMPT, 12)])[950].token_ids
    bad = _bad_requests()
    mixed = [bad[901][0], make_request(960, PROMPT, 12), *(r for rid, (r, _) in bad.items() if rid != 901)]
    outcomes, refused = _run_isolated(shard, 951, mixed)
    assert set(refused) == set(bad)
    for rid, (_, piece) in bad.items():
        assert piece in refused[rid], (rid, refused[rid])
        assert not refused[rid].startswith("request "), "the message is for the client, without our ids"
    assert set(outcomes) == {960}
    assert outcomes[960].token_ids == solo


def test_a_batch_of_only_bad_requests_leaves_nothing_cached(shard: Stub) -> None:
    bad = _bad_requests()
    answer = shard.Prefill(generate_pb2.PrefillRequest(
        batch=make_batch(970, [bad[901][0], bad[903][0]]), per_request_errors=True))
    assert not answer.generations and not answer.HasField("batch")
    assert [e.request_id for e in answer.request_errors] == [901, 903]
    with pytest.raises(grpc.RpcError) as err:
        shard.FilterBatch(generate_pb2.FilterBatchRequest(batch_id=970, request_ids=[901]))
    assert err.value.details() == "Batch ID 970 not found in cache."
