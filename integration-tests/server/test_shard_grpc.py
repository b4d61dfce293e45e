"""The shard over its real unix socket, on the real default model, with the generated client."""

from __future__ import annotations

import math
import re
from pathlib import Path

import grpc
import pytest

from text_generation_server.download import DEFAULT_MODEL_ID
from text_generation_server.models.runner import cpu_kernels
from text_generation_server.pb import generate_pb2, generate_pb2_grpc

from factories import CHAT_FRANCE, Outcome, collect, make_batch, make_request, run_to_completion
from shard_process import ShardProcess

Stub = generate_pb2_grpc.TextGenerationServiceStub


def test_handshake_and_greedy_chat_answer(shard: Stub) -> None:
    discovery = shard.ServiceDiscovery(generate_pb2.ServiceDiscoveryRequest())
    assert len(discovery.urls) == 1 and discovery.urls[0].startswith("unix://")
    shard.ClearCache(generate_pb2.ClearCacheRequest())
    info = shard.Info(generate_pb2.InfoRequest())
    # upstream v3's paged protocol: chunks (Prefill with cached_batch); PREFIX_CACHING=0 here
    assert not info.requires_padding and info.support_chunking and not info.use_prefix_caching
    assert (info.attention_impl, info.block_size) == ("paged", 16)
    assert info.dtype == "torch.float32" and info.device_type == "cpu"
    assert info.block_size >= 1 and info.speculate == 0 and not info.HasField("window_size")
    ops = cpu_kernels.load(kind="float32")  # the shard reads the same measured choice (kernel_choice.py)
    assert info.cpu_kernels == ("none" if ops is None else ops.variant)
    warmup = shard.Warmup(generate_pb2.WarmupRequest(  # upstream's router warms up with watermark on
        batch=make_batch(7, [make_request(0, "warm up " * 40, 2, ignore_eos=True, watermark=True)]),
        max_input_tokens=1000, max_prefill_tokens=1024, max_total_tokens=1024))
    assert (warmup.max_input_tokens, warmup.max_total_tokens) == (1000, 1024)
    assert not warmup.HasField("max_supported_total_tokens")

    prefill = shard.Prefill(generate_pb2.PrefillRequest(batch=make_batch(1, [make_request(10, CHAT_FRANCE, 24)])))
    outcomes: dict[int, Outcome] = {}
    collect(outcomes, list(prefill.generations))
    assert prefill.batch.id == 1 and list(prefill.batch.request_ids) == [10]
    assert prefill.forward_ns > 0 and prefill.total_ns >= prefill.forward_ns
    cached = prefill.batch
    while outcomes[10].final is None:
        decoded = shard.Decode(generate_pb2.DecodeRequest(batches=[cached]))
        collect(outcomes, list(decoded.generations))
        cached = decoded.batch
    final = outcomes[10].final
    assert final is not None and "Paris" in final.text
    assert final.finish_reason == generate_pb2.FINISH_REASON_EOS_TOKEN
    assert not final.HasField("seed")  # greedy
    assert "<|im_end|>" in outcomes[10].texts[-1] and "<|im_end|>" not in final.text

    # A finished request stays in the cache until filtered or cleared.
    two = shard.Prefill(generate_pb2.PrefillRequest(batch=make_batch(2, [
        make_request(20, "One, two, three,", 5), make_request(21, "Hello", 5)])))
    filtered = shard.FilterBatch(generate_pb2.FilterBatchRequest(batch_id=2, request_ids=[21]))
    assert filtered.batch.id == 2 and list(filtered.batch.request_ids) == [21] and filtered.batch.size == 1
    assert two.batch.size == 2
    shard.ClearCache(generate_pb2.ClearCacheRequest(id=2))
    with pytest.raises(grpc.RpcError) as err:
        shard.Decode(generate_pb2.DecodeRequest(batches=[filtered.batch]))
    assert err.value.details() == "Batch ID 2 not found in cache."


def test_a_warm_up_in_chunks_says_how_far_it_is(model_path: Path) -> None:
    """The router's warm-up prefills a batch of --max-batch-prefill-tokens (minutes on quantized
    weights): the shard logs its progress at each chunk, not only at the end."""
    process = ShardProcess(DEFAULT_MODEL_ID, [], env={"PREFILL_CHUNK_TOKENS": "32"})
    try:
        shard = process.wait_ready()
        request = make_request(0, "warm up " * 40, 2, ignore_eos=True)
        shard.Warmup(generate_pb2.WarmupRequest(batch=make_batch(7, [request]), max_input_tokens=1000,
                                                max_prefill_tokens=1024, max_total_tokens=1024))
        log = Path(process.log_path).read_text()
    finally:
        process.stop()
    progress = [(int(done.replace(",", "")), int(total.replace(",", ""))) for done, total in
                re.findall(r"Warm-up: ([\d,]+) of ([\d,]+) prompt tokens prefilled", log)]
    assert len(progress) >= 2, log[-3000:]
    done = [d for d, _ in progress]
    assert done == sorted(done) and done[-1] > done[0], progress
    assert {total for _, total in progress} == {progress[0][1]} and progress[0][1] >= 80, progress
    assert "Warmup done" in log


def _alone(shard: Stub, request: generate_pb2.Request, batch_id: int) -> list[int]:
    return run_to_completion(shard, batch_id, [request])[request.id].token_ids


def test_batch_invariance_with_concatenate_and_filter(shard: Stub) -> None:
    requests = [
        make_request(100, "The capital of Italy is", 6),
        make_request(101, "Write a haiku about the sea. The waves", 12),
        make_request(102, "def fibonacci(n):", 9, repetition_penalty=1.3),
        make_request(103, "Once", 4),
    ]
    alone = {r.id: _alone(shard, r, 200 + i) for i, r in enumerate(requests)}

    outcomes: dict[int, Outcome] = {}
    first = shard.Prefill(generate_pb2.PrefillRequest(batch=make_batch(300, requests[:2])))
    collect(outcomes, list(first.generations))
    running = first.batch
    for _ in range(2):
        step = shard.Decode(generate_pb2.DecodeRequest(batches=[running]))
        collect(outcomes, list(step.generations))
        running = step.batch
    second = shard.Prefill(generate_pb2.PrefillRequest(batch=make_batch(301, requests[2:])))
    collect(outcomes, list(second.generations))
    step = shard.Decode(generate_pb2.DecodeRequest(batches=[running, second.batch]))
    assert step.batch.id == 300 and step.HasField("concat_ns")
    assert list(step.batch.request_ids) == [100, 101, 102, 103]
    collect(outcomes, list(step.generations))
    cached = step.batch
    while cached is not None:
        live = [rid for rid in cached.request_ids if outcomes[rid].final is None]
        if live != list(cached.request_ids):
            live.reverse()  # FilterBatch keeps the listed order
            cached = shard.FilterBatch(generate_pb2.FilterBatchRequest(batch_id=cached.id, request_ids=live)).batch
            assert list(cached.request_ids) == live
        step = shard.Decode(generate_pb2.DecodeRequest(batches=[cached]))
        collect(outcomes, list(step.generations))
        cached = step.batch if step.HasField("batch") else None
    for request in requests:
        assert outcomes[request.id].token_ids == alone[request.id], f"request {request.id} differs in a batch"


def test_seeded_sampling_is_reproducible(shard: Stub) -> None:
    def sample(seed: int, batch_id: int) -> list[int]:
        r = make_request(400, "Tell me a story about a dragon.", 12, do_sample=True, seed=seed,
                         temperature=0.9, top_k=50, top_p=0.95)
        outcome = run_to_completion(shard, batch_id, [r])[400]
        assert outcome.final is not None and outcome.final.seed == seed
        return outcome.token_ids

    first, again, other = sample(42, 401), sample(42, 402), sample(7, 403)
    assert first == again
    assert first != other


def test_each_finish_reason(shard: Stub) -> None:
    out = run_to_completion(shard, 500, [
        make_request(501, "Count: 1, 2, 3,", 3),
        make_request(502, CHAT_FRANCE, 40),
        make_request(503, CHAT_FRANCE, 40, stop=("Paris",)),
        make_request(504, CHAT_FRANCE, 12, ignore_eos=True),
    ])
    assert out[501].final is not None and out[501].final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert out[501].final.generated_tokens == 3
    assert out[502].final is not None and out[502].final.finish_reason == generate_pb2.FINISH_REASON_EOS_TOKEN
    stopped = out[503].final
    assert stopped is not None and stopped.finish_reason == generate_pb2.FINISH_REASON_STOP_SEQUENCE
    assert stopped.text.endswith("Paris")  # the stop sequence stays in the text
    assert out[504].final is not None and out[504].final.generated_tokens == 12
    assert out[504].final.finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_top_n_tokens_and_prefill_logprobs_shapes(shard: Stub) -> None:
    prompt = "The quick brown fox jumps"
    out = run_to_completion(shard, 600, [make_request(601, prompt, 4, top_n_tokens=3, prefill_logprobs=True)])[601]
    assert out.prefill is not None
    num_prompt = len(out.prefill.ids)
    assert num_prompt >= 4 and len(out.prefill.logprobs) == len(out.prefill.texts) == num_prompt
    assert math.isnan(out.prefill.logprobs[0])
    assert all(lp <= 0 for lp in out.prefill.logprobs[1:])
    assert "".join(out.prefill.texts) == prompt
    assert len(out.top_tokens) == len(out.token_ids) == 4
    for top, token, logprob in zip(out.top_tokens, out.token_ids, out.logprobs, strict=True):
        assert len(top.ids) >= 3 and len(top.ids) == len(top.logprobs) == len(top.texts) == len(top.is_special)
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        assert top.ids[0] == token and top.logprobs[0] == pytest.approx(logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.Decode(generate_pb2.DecodeRequest(batches=[generate_pb2.CachedBatch(id=999)])),
         "Batch ID 999 not found in cache."),
        (lambda s: s.Decode(generate_pb2.DecodeRequest()), "Decode needs at least one batch"),
        (lambda s: s.FilterBatch(generate_pb2.FilterBatchRequest(batch_id=998, request_ids=[1])),
         "Batch ID 998 not found in cache."),
        (lambda s: s.Prefill(generate_pb2.PrefillRequest(batch=make_batch(700, [make_request(701, "", 4)]))),
         "request 701: empty input"),
        (lambda s: s.Prefill(generate_pb2.PrefillRequest(batch=make_batch(702, [
            make_request(703, "hello", 4, grammar="[0-9]+")]))),
         "request 703: a grammar was sent with GRAMMAR_TYPE_NONE"),
        (lambda s: s.Prefill(generate_pb2.PrefillRequest(batch=make_batch(704, [
            make_request(705, "hello", 4, grammar="(unclosed", grammar_type=generate_pb2.GRAMMAR_TYPE_REGEX)]))),
         "request 705: grammar is not valid: regex grammar does not compile"),
        (lambda s: s.Prefill(generate_pb2.PrefillRequest(batch=make_batch(708, [
            make_request(709, "hello", 4, grammar="{no", grammar_type=generate_pb2.GRAMMAR_TYPE_JSON)]))),
         "request 709: grammar is not valid: the JSON schema is not JSON"),
        (lambda s: s.Prefill(generate_pb2.PrefillRequest(batch=make_batch(706, [
            make_request(707, "hello", 0)]))), "max_new_tokens must be strictly positive, got 0"),
    ],
)
def test_bad_inputs_are_refused_and_the_shard_keeps_serving(shard: Stub, call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call(shard)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    shard.Health(generate_pb2.HealthRequest())
    assert run_to_completion(shard, 710, [make_request(711, "Hi", 2)])[711].final is not None


def test_empty_filter_list_keeps_the_batch(shard: Stub) -> None:
    prefill = shard.Prefill(generate_pb2.PrefillRequest(batch=make_batch(720, [make_request(721, "Hello", 5)])))
    with pytest.raises(grpc.RpcError) as err:
        shard.FilterBatch(generate_pb2.FilterBatchRequest(batch_id=720, request_ids=[]))
    assert "empty request list" in err.value.details()
    step = shard.Decode(generate_pb2.DecodeRequest(batches=[prefill.batch]))  # still cached
    assert len(step.generations) == 1
    shard.ClearCache(generate_pb2.ClearCacheRequest(id=720))


def test_decode_with_a_missing_batch_loses_nothing(shard: Stub) -> None:
    prefill = shard.Prefill(generate_pb2.PrefillRequest(batch=make_batch(730, [make_request(731, "Hello", 5)])))
    missing = generate_pb2.CachedBatch(id=739, request_ids=[1], size=1)
    with pytest.raises(grpc.RpcError) as err:
        shard.Decode(generate_pb2.DecodeRequest(batches=[prefill.batch, missing]))
    assert err.value.details() == "Batch ID 739 not found in cache."
    step = shard.Decode(generate_pb2.DecodeRequest(batches=[prefill.batch]))  # batch 730 is still cached
    assert [g.request_id for g in step.generations] == [731]
    shard.ClearCache(generate_pb2.ClearCacheRequest(id=730))
