"""Startup handshake with the shards (docs/tgi-interface.md §1.4): discovery, clear, info, warmup, limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from loguru import logger

from text_generation_router.config import RouterConfig, ServingLimits
from text_generation_router.engine.client import ShardClient, memory_bytes
from text_generation_router.engine.dispatch import WarmupResponse, build_warmup_batch, warmup_request


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
    use_prefix_caching: bool = False
    memory: dict[str, int] = field(default_factory=dict)  # bytes by part after warm-up (extension)


def limits_from_warmup(
    config: RouterConfig, answers: list[WarmupResponse], support_chunking: bool
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
    request = warmup_request(batch, config.max_batch_prefill_tokens, config.max_input_tokens,
                             config.max_total_tokens)
    answers = await client.warmup(request)
    limits = limits_from_warmup(config, answers, info.support_chunking)
    shard = ShardInfo(
        requires_padding=info.requires_padding, dtype=info.dtype, device_type=info.device_type,
        speculate=info.speculate, support_chunking=info.support_chunking,
        block_size=info.block_size, runner=info.runner, layer_skip_mode=info.layer_skip_mode,
        layer_skip_policy_state=info.layer_skip_policy_state, use_prefix_caching=info.use_prefix_caching,
        memory=memory_bytes(answers),
    )
    logger.info("Warmup done: {}", limits)
    return client, shard, limits
