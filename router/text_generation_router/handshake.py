"""Startup handshake with the shards (spec §1.4): discovery, clear, info, warmup, limits."""

from __future__ import annotations

from dataclasses import dataclass

from loguru import logger

from text_generation_router.client import ShardClient
from text_generation_router.config import RouterConfig, ServingLimits
from text_generation_router.pb import generate_pb2 as pb


@dataclass(frozen=True)
class ShardInfo:
    """What the router keeps of InfoResponse."""

    requires_padding: bool
    dtype: str
    device_type: str
    speculate: int
    support_chunking: bool
    block_size: int
    runner: str
    layer_skip_mode: str
    layer_skip_policy_state: str = "none"


def build_warmup_batch(
    max_input_tokens: int | None,
    max_prefill_tokens: int,
    max_total_tokens: int | None,
    max_batch_size: int | None,
) -> pb.Batch:
    """Dry-run batch of spec §1.4 step 5: `_test ` prompts summing to max_prefill_tokens.

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
                input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
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


def limits_from_warmup(
    config: RouterConfig, answers: list[pb.WarmupResponse], support_chunking: bool
) -> ServingLimits:
    """Element-wise minimum of the shards' answers, checked as upstream does (step 6)."""
    max_input = min(a.max_input_tokens for a in answers)
    max_total = min(a.max_total_tokens for a in answers)
    if config.max_input_tokens is not None and max_input != config.max_input_tokens:
        raise RuntimeError(f"shard changed max_input_tokens {config.max_input_tokens} -> {max_input}")
    if config.max_total_tokens is not None and max_total != config.max_total_tokens:
        raise RuntimeError(f"shard changed max_total_tokens {config.max_total_tokens} -> {max_total}")
    supported = [a.max_supported_total_tokens for a in answers if a.HasField("max_supported_total_tokens")]
    if supported:
        batch_total = min(supported)
        if config.max_batch_total_tokens is not None:
            logger.warning("--max-batch-total-tokens is ignored: the shard reported {}", batch_total)
        if batch_total < max_total:
            raise RuntimeError("Not enough memory to handle `max_total_tokens` tokens")
    else:
        batch_total = config.max_batch_total_tokens or max(
            16000, max_total, config.max_batch_prefill_tokens
        )
    if not support_chunking and config.max_batch_prefill_tokens < max_input:
        raise ValueError(
            f"`max_batch_prefill_tokens` ({config.max_batch_prefill_tokens}) must be >= "
            f"`max_input_tokens` ({max_input})"
        )
    return ServingLimits(
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_prefill_tokens=config.max_batch_prefill_tokens,
        max_batch_total_tokens=batch_total,
    )


async def handshake(config: RouterConfig) -> tuple[ShardClient, ShardInfo, ServingLimits]:
    """Connect to the shards and agree on limits; raises if the shard is unusable."""
    client = await ShardClient.connect(config.master_shard_uds_path)
    await client.clear_cache(None)
    info = await client.info()
    if info.block_size < 1:
        raise RuntimeError(f"shard reported block_size={info.block_size}; it must be >= 1")
    batch = build_warmup_batch(
        config.max_input_tokens, config.max_batch_prefill_tokens, config.max_total_tokens,
        config.max_batch_size,
    )
    request = pb.WarmupRequest(batch=batch, max_prefill_tokens=config.max_batch_prefill_tokens)
    if config.max_input_tokens is not None:
        request.max_input_tokens = config.max_input_tokens
    if config.max_total_tokens is not None:
        request.max_total_tokens = config.max_total_tokens
    limits = limits_from_warmup(config, await client.warmup(request), info.support_chunking)
    shard = ShardInfo(
        requires_padding=info.requires_padding, dtype=info.dtype, device_type=info.device_type,
        speculate=info.speculate, support_chunking=info.support_chunking,
        block_size=info.block_size, runner=info.runner, layer_skip_mode=info.layer_skip_mode,
        layer_skip_policy_state=info.layer_skip_policy_state,
    )
    logger.info("Warmup done: {}", limits)
    return client, shard, limits
