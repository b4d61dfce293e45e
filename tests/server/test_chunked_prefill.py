"""Chunked prefill on the real default model: a long prompt runs in chunks between the running
requests' steps, gives the tokens it gives prefilled at once, and the running request goes on
(one token each step) meanwhile; a request cancelled mid-prefill leaves the others running."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_layer_skip_shard import make_lm

from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.prefix_cache import PrefixCache
from text_generation_server.pb import generate_pb2

from factories import decode_in_process, make_batch, make_request
from prompt_sets import LONG, chat_text

CHUNK = 64
LONG_CHAT = "Read these notes, then answer. " + " ".join(LONG) + "\nWhat is the first note about?"


@pytest.fixture(scope="module")
def lm(model_path: Path) -> CausalLM:
    from text_generation_server.models.loading import LoadConfig, load_model

    return make_lm(model_path, load_model(model_path, LoadConfig()), "off", None)


def new_batch(lm: CausalLM, batch_id: int, requests: list[generate_pb2.Request]) -> CausalLMBatch:
    return CausalLMBatch.from_pb(make_batch(batch_id, requests), lm.tokenizer, lm.runner.num_layers,
                                 lm.eos_token_ids, 4000)


def alone(lm: CausalLM, request: generate_pb2.Request, chunk: int = 0) -> list[int]:
    lm.prefill_chunk = chunk
    try:
        return decode_in_process(lm, new_batch(lm, 99, [request])).tokens[request.id]
    finally:
        lm.prefill_chunk = 0


def test_a_chunked_prompt_gives_the_tokens_of_one_prefill(lm: CausalLM) -> None:
    prompt = chat_text(lm.tokenizer, LONG_CHAT)
    assert len(lm.tokenizer(prompt)["input_ids"]) > 4 * CHUNK
    request = make_request(1, prompt, 12)
    assert alone(lm, request, CHUNK) == alone(lm, request)
    seeded = make_request(2, prompt, 12, do_sample=True, seed=3, temperature=0.9)
    assert alone(lm, seeded, CHUNK) == alone(lm, seeded)


def test_prompt_logprobs_are_scored_chunk_by_chunk(lm: CausalLM) -> None:
    """Two rows of different lengths asking for their prompts' logprobs, in chunks: each position's
    logprob of the next prompt token is the one a whole prefill gives (the chunks' boundaries
    included), and so are the tokens."""
    prompts = [chat_text(lm.tokenizer, LONG_CHAT), chat_text(lm.tokenizer, "Summarise: " + " ".join(LONG[:3]))]

    def run(chunk: int) -> tuple[dict[int, list[float]], dict[int, list[int]]]:
        requests = [make_request(i + 1, p, 6, prefill_logprobs=True) for i, p in enumerate(prompts)]
        scores: dict[int, list[float]] = {}
        tokens: dict[int, list[int]] = {1: [], 2: []}
        lm.prefill_chunk = chunk
        try:
            current: CausalLMBatch | None = new_batch(lm, 7, requests)
            while current is not None:
                generations, current, _ = lm.generate_token(current)
                for g in generations:
                    tokens[g.request_id] += g.tokens.ids
                    if g.prefill_tokens is not None:
                        scores[g.request_id] = g.prefill_tokens.logprobs
        finally:
            lm.prefill_chunk = 0
        return scores, tokens

    (chunked, chunked_tokens), (whole, whole_tokens) = run(CHUNK), run(0)
    assert chunked_tokens == whole_tokens
    for rid in (1, 2):
        assert len(chunked[rid]) == len(whole[rid]) == len(lm.tokenizer(prompts[rid - 1])["input_ids"])
        assert chunked[rid][0] != chunked[rid][0]  # the first prompt token has no logprob (NaN)
        torch.testing.assert_close(torch.tensor(chunked[rid][1:]), torch.tensor(whole[rid][1:]), atol=1e-4, rtol=0)


def test_a_running_stream_goes_on_while_a_long_prompt_prefills(lm: CausalLM) -> None:
    running = make_request(1, chat_text(lm.tokenizer, "Count from one to twenty."), 40, ignore_eos=True)
    long = make_request(2, chat_text(lm.tokenizer, LONG_CHAT), 8)
    expected = {1: alone(lm, running), 2: alone(lm, long)}
    n = len(lm.tokenizer(long.inputs)["input_ids"])
    lm.prefill_chunk = CHUNK
    try:
        tokens: dict[int, list[int]] = {1: [], 2: []}
        steps_without_2 = 0
        generations, batch, _ = lm.generate_token(new_batch(lm, 1, [running]))
        for g in generations:
            tokens[g.request_id] += g.tokens.ids
        generations, incoming, _ = lm.generate_token(new_batch(lm, 2, [long]))  # Prefill: plans, runs no chunk
        assert generations == [] and incoming is not None and incoming.groups[0].cache.length == 0
        assert batch is not None
        current: CausalLMBatch | None = CausalLMBatch.concatenate([batch, incoming])
        while current is not None:
            generations, current, _ = lm.generate_token(current)
            got = {g.request_id for g in generations}
            assert 1 in got or tokens[1] == expected[1]  # the running request gets a token every step
            steps_without_2 += not tokens[2] and 2 not in got
            for g in generations:
                tokens[g.request_id] += g.tokens.ids
    finally:
        lm.prefill_chunk = 0
    assert tokens == expected
    assert steps_without_2 == -(-n // CHUNK) - 1  # a step per chunk but the last, which chooses its first token


def test_a_request_cancelled_mid_prefill_leaves_the_others_running(lm: CausalLM) -> None:
    first = make_request(1, chat_text(lm.tokenizer, "Name three colours."), 10)
    long = make_request(2, chat_text(lm.tokenizer, LONG_CHAT), 8)
    lm.prefill_chunk = CHUNK
    try:
        _, batch, _ = lm.generate_token(new_batch(lm, 1, [first]))
        _, incoming, _ = lm.generate_token(new_batch(lm, 2, [long]))
        assert batch is not None and incoming is not None
        merged = CausalLMBatch.concatenate([batch, incoming])
        lm.generate_token(merged)
        rest = decode_in_process(lm, merged.filter([1]))  # the router's FilterBatch after a cancel
    finally:
        lm.prefill_chunk = 0
    assert [s.id for s in rest.last.requests] == [1]
    assert len(rest.tokens[1]) > 0


def test_chunks_after_a_cached_prefix(lm: CausalLM) -> None:
    prompt = chat_text(lm.tokenizer, LONG_CHAT)
    request = make_request(1, prompt, 10)
    expected = alone(lm, request)
    lm.prefixes = PrefixCache(256 << 20)
    try:
        head = chat_text(lm.tokenizer, LONG_CHAT[: len(LONG_CHAT) // 2])  # shares the first half
        alone(lm, make_request(2, head, 4), CHUNK)
        assert alone(lm, request, CHUNK) == expected
        assert lm.prefixes.stats.hit_tokens > CHUNK
    finally:
        lm.prefixes = None
