"""The router's protobuf boundary: every pb message the router sends is built here (the
batcher's entries -> pb.Batch, the handshake's warmup, /health's probe), and pb.Generation
becomes events here. Other modules name the shard's answers through the aliases below.

Containment rule: whatever goes wrong with one entry here (a value protobuf cannot encode, a
refusal the shard reports for one request) ends that entry alone with its error event; the
other entries of the batch are sent and served as if it had never been there.
"""

from __future__ import annotations

import dataclasses
import time

from loguru import logger

from text_generation_router.engine.events import (
    GeneratedText,
    LayerSkipReport,
    PrefillEvent,
    Token,
    TokenEvent,
)
from text_generation_router.engine.metrics import Metrics
from text_generation_router.engine.queue import Entry
from text_generation_router.pb import generate_pb2 as pb

CachedBatch = pb.CachedBatch  # the shard's handle of a batch it keeps; the batcher passes it back
WarmupResponse = pb.WarmupResponse

HEALTH_BATCH_ID = 2**64 - 1

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}


def _text_input(text: str) -> pb.Input:
    """The prompt as the one text chunk v3 shards read (the router serves text only)."""
    return pb.Input(chunks=[pb.InputChunk(text=text)])


def to_pb_request(entry: Entry) -> pb.Request:
    r = entry.request
    p = r.parameters
    request = pb.Request(
        id=entry.id,
        inputs=r.inputs,
        input_chunks=_text_input(r.inputs),
        truncate=r.truncate,
        add_special_tokens=r.add_special_tokens,
        prefill_logprobs=r.decoder_input_details,
        top_n_tokens=r.top_n_tokens,
        layer_skip_mode=r.layer_skip_mode,
        parameters=pb.NextTokenChooserParameters(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, typical_p=p.typical_p,
            do_sample=p.do_sample, seed=p.seed, repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty, watermark=p.watermark, grammar=p.grammar,
            grammar_type=p.grammar_type,  # type: ignore[arg-type]
        ),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=r.max_new_tokens, stop_sequences=r.stop_sequences,
            ignore_eos_token=False,
        ),
    )
    if r.adapter_id is not None:
        request.adapter_id = r.adapter_id
    if entry.allocation is not None:  # a paged shard: its blocks, and the prompt tokens cached in them
        request.blocks.extend(entry.allocation.blocks)
        request.slots.extend(entry.allocation.slots)
        request.cache_len = entry.allocation.prefix_len
    if entry.chunk_len is not None:
        request.chunk_len = entry.chunk_len
    return request


def encode_requests(entries: dict[int, Entry]) -> list[pb.Request]:
    """Encode each entry; one that protobuf refuses (out of range, not encodable as UTF-8, a
    wrong type) fails alone with a 422 and leaves `entries`."""
    requests = []
    for entry in list(entries.values()):
        try:
            requests.append(to_pb_request(entry))
        except (ValueError, TypeError) as err:  # protobuf's errors for a value it cannot encode
            logger.warning("request {} cannot be encoded for the shard: {}", entry.id, err)
            entry.fail("validation", f"a parameter cannot be sent to the shard: {err}")
            del entries[entry.id]
    return requests


def to_pb_batch(batch_id: int, entries: list[Entry], requests: list[pb.Request]) -> pb.Batch:
    """A padded batch (no blocks: max_tokens is the padded estimate) or a paged one (max_tokens:
    the prompt tokens to run, as upstream counts them; max_blocks: the most a request holds)."""
    allocations = [e.allocation for e in entries if e.allocation is not None]
    if allocations:
        max_tokens = sum(e.request.input_length - e.allocation.prefix_len for e in entries
                         if e.allocation is not None and e.chunk_len is None)
        max_blocks = max(len(a.blocks) for a in allocations)
    else:
        max_input = max(e.request.input_length for e in entries)
        max_tokens = len(entries) * max_input + sum(e.request.max_new_tokens for e in entries)
        max_blocks = 0
    return pb.Batch(id=batch_id, requests=requests, size=len(entries), max_tokens=max_tokens,
                    max_blocks=max_blocks)


def build_warmup_batch(
    max_input_tokens: int | None,
    max_prefill_tokens: int,
    max_total_tokens: int | None,
    max_batch_size: int | None,
) -> pb.Batch:
    """Dry-run batch of docs/tgi-interface.md §1.4 step 5: `_test ` prompts summing to max_prefill_tokens.

    The image chunk upstream adds for vision models is left out: this router serves text.
    """
    requests: list[pb.Request] = []
    remaining = max_prefill_tokens
    while remaining > 0 and (max_batch_size is None or len(requests) < max_batch_size):
        truncate = min(remaining, max_input_tokens) if max_input_tokens else remaining
        remaining -= truncate
        text = "_test " * truncate
        max_new = max_total_tokens - truncate if max_total_tokens else 1
        requests.append(
            pb.Request(
                id=0,
                inputs=text,
                input_chunks=_text_input(text),
                truncate=truncate,
                add_special_tokens=True,
                prefill_logprobs=True,
                top_n_tokens=20,
                parameters=pb.NextTokenChooserParameters(
                    temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, do_sample=False,
                    # Upstream sends watermark=true; shards without watermarking (ours)
                    # reject it, and warmup does not need it to size memory.
                    seed=0, repetition_penalty=1.2, frequency_penalty=0.1, watermark=False,
                    grammar="", grammar_type=pb.GRAMMAR_TYPE_NONE,
                ),
                stopping_parameters=pb.StoppingCriteriaParameters(
                    max_new_tokens=max(max_new, 1), stop_sequences=[], ignore_eos_token=True
                ),
            )
        )
    return pb.Batch(
        id=0, requests=requests, size=len(requests), max_tokens=max_input_tokens or 0,
        max_blocks=0,
    )


def warmup_request(
    batch: pb.Batch, max_prefill_tokens: int, max_input_tokens: int | None, max_total_tokens: int | None
) -> pb.WarmupRequest:
    """Warmup of `batch`; the limits the operator fixed are sent, the others left to the shard."""
    request = pb.WarmupRequest(batch=batch, max_prefill_tokens=max_prefill_tokens)
    if max_input_tokens is not None:
        request.max_input_tokens = max_input_tokens
    if max_total_tokens is not None:
        request.max_total_tokens = max_total_tokens
    return request


def health_batch() -> pb.Batch:
    """A one-token Prefill of a fixed prompt, as /health sends once generation failed."""
    request = pb.Request(
        id=HEALTH_BATCH_ID, inputs="liveness", truncate=1, add_special_tokens=False,
        input_chunks=_text_input("liveness"),
        parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                 repetition_penalty=1.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1),
        blocks=[0], slots=[0],
    )
    return pb.Batch(id=HEALTH_BATCH_ID, requests=[request], size=1, max_tokens=2, max_blocks=1)


def dispatch_request_errors(errors: list[tuple[int, str]], entries: dict[int, Entry]) -> None:
    """The shard refused these requests alone (request_errors extension): 422 each."""
    for request_id, message in errors:
        entry = entries.pop(request_id, None)
        if entry is not None:
            entry.fail("validation", message)


def _tokens(t: pb.Tokens) -> list[Token]:
    special = list(t.is_special) or [False] * len(t.ids)
    return [
        Token(id=i, text=text, logprob=lp, special=sp)
        for i, lp, text, sp in zip(t.ids, t.logprobs, t.texts, special, strict=False)
    ]


def _layer_skip(g: pb.Generation) -> LayerSkipReport | None:
    if not g.HasField("layer_skip"):
        return None
    r = g.layer_skip
    return LayerSkipReport(
        mode=r.mode, skipped_layers=list(r.skipped_layers), rule=r.rule,
        max_score=r.max_score, mean_score=r.mean_score, stats=dict(r.stats),
    )


def _generated_text(g: pb.Generation) -> GeneratedText | None:
    if not g.HasField("generated_text"):
        return None
    gt = g.generated_text
    return GeneratedText(
        text=gt.text,
        generated_tokens=gt.generated_tokens,
        finish_reason=FINISH_REASONS.get(gt.finish_reason, "length"),
        seed=gt.seed if gt.HasField("seed") else None,
    )


def dispatch_generations(
    generations: list[pb.Generation], entries: dict[int, Entry], metrics: Metrics
) -> None:
    """Send each generation to its request; forget requests that ended or went away."""
    for g in generations:
        entry = entries.get(g.request_id)
        if entry is None:
            continue
        entry.prefilled = True  # its prompt's keys and values are in the shard now
        if entry.dropped or entry.done:  # client gone (counted by Infer), or already failed
            entry.done = True
            del entries[g.request_id]
            continue
        report = _layer_skip(g)
        if report is not None:  # the plan on the first generation, drafting stats on the last
            if entry.layer_skip is None:
                metrics.layer_skip.observe_plan(report)
            entry.layer_skip = report
        if g.HasField("cached_tokens"):
            entry.cached_tokens = g.cached_tokens
            metrics.request_prefix_cached_tokens.observe(g.cached_tokens)
        if g.HasField("prefill_tokens") and len(g.prefill_tokens.ids) > 0:
            entry.events.put_nowait(PrefillEvent(_tokens(g.prefill_tokens)))
        tokens = _tokens(g.tokens)
        end = _generated_text(g)
        if end is not None and entry.cached_tokens:
            end = dataclasses.replace(end, cached_tokens=entry.cached_tokens)
        for n, token in enumerate(tokens):
            top = _tokens(g.top_tokens[n]) if n < len(g.top_tokens) else []
            last = n == len(tokens) - 1
            entry.events.put_nowait(
                TokenEvent(
                    token=token, top_tokens=top, end=end if last else None,
                    layer_skip=entry.layer_skip,
                )
            )
        if end is not None:
            entry.done = True
            del entries[g.request_id]
            _observe_end(entry, end, metrics)


def _observe_end(entry: Entry, end: GeneratedText, metrics: Metrics) -> None:
    now = time.monotonic()
    batched_at = entry.batched_at or now
    metrics.request_queue_duration.observe(batched_at - entry.queued_at)
    metrics.request_inference_duration.observe(now - batched_at)
    metrics.request_generated_tokens.observe(end.generated_tokens)
    metrics.request_skipped_tokens.observe(metrics.layer_skip.observe_end(entry.layer_skip))
    if end.generated_tokens:
        metrics.request_mean_time_per_token_duration.observe(
            (now - batched_at) / end.generated_tokens
        )
