"""`text-generation-router`: handshake with the shard, then serve HTTP (docs/tgi-interface.md §3.2 step 3)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from loguru import logger

from text_generation_router.config import RouterConfig
from text_generation_router.engine.batcher import Batcher, Health
from text_generation_router.engine.handshake import handshake
from text_generation_router.engine.infer import Infer
from text_generation_router.engine.metrics import build_metrics
from text_generation_router.engine.queue import Queue
from text_generation_router.engine.tokenizer import Tokenizer
from text_generation_router.engine.validation import Limits
from text_generation_router.env import RouterEnv
from text_generation_router.http.metrics_port import serve_metrics
from text_generation_router.http.server import build_app
from text_generation_router.http.shutdown import Drain, GracefulServer, server_config
from text_generation_router.http.state import AppState


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="text-generation-router")
    p.add_argument("--master-shard-uds-path", default="/tmp/text-generation-server-0")
    p.add_argument("--tokenizer-name", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--hostname", default="0.0.0.0")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--prometheus-port", type=int, default=9000)
    for flag, default in (
        ("--max-concurrent-requests", 128), ("--max-best-of", 2), ("--max-stop-sequences", 4),
        ("--max-top-n-tokens", 5), ("--max-batch-prefill-tokens", 4096),
        ("--max-waiting-tokens", 20), ("--max-client-batch-size", 4),
        ("--validation-workers", 2), ("--payload-limit", 2_000_000),
    ):
        p.add_argument(flag, type=int, default=default)
    for flag in ("--max-input-tokens", "--max-total-tokens", "--max-batch-total-tokens",
                 "--max-batch-size"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--waiting-served-ratio", type=float, default=1.2)
    p.add_argument("--api-key", default=None)
    p.add_argument("--cors-allow-origin", action="append", default=[])
    p.add_argument("--disable-grammar-support", action="store_true")
    p.add_argument("--json-output", action="store_true")
    # Seconds; the launcher passes its own --graceful-termination-timeout.
    p.add_argument("--graceful-termination-timeout", type=float, default=90.0)
    p.add_argument("--request-header-timeout", type=float, default=10.0)
    # Accepted for argv compatibility with upstream's launcher; they change nothing here.
    for flag in ("--revision", "--tokenizer-config-path", "--usage-stats", "--otlp-endpoint",
                 "--otlp-service-name", "--max-image-fetch-size"):
        p.add_argument(flag, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def config_from_args(argv: list[str] | None = None) -> RouterConfig:
    a = build_parser().parse_args(argv)
    return RouterConfig(
        master_shard_uds_path=a.master_shard_uds_path, tokenizer_name=a.tokenizer_name,
        served_model_name=a.served_model_name, hostname=a.hostname, port=a.port, prometheus_port=a.prometheus_port,
        max_concurrent_requests=a.max_concurrent_requests, max_best_of=a.max_best_of,
        max_stop_sequences=a.max_stop_sequences, max_top_n_tokens=a.max_top_n_tokens,
        max_input_tokens=a.max_input_tokens, max_total_tokens=a.max_total_tokens,
        waiting_served_ratio=a.waiting_served_ratio,
        max_batch_prefill_tokens=a.max_batch_prefill_tokens,
        max_batch_total_tokens=a.max_batch_total_tokens,
        max_waiting_tokens=a.max_waiting_tokens, max_batch_size=a.max_batch_size,
        max_client_batch_size=a.max_client_batch_size, validation_workers=a.validation_workers,
        api_key=a.api_key, cors_allow_origin=tuple(a.cors_allow_origin),
        payload_limit=a.payload_limit, disable_grammar_support=a.disable_grammar_support,
        json_output=a.json_output, graceful_termination_timeout_s=a.graceful_termination_timeout,
        request_header_timeout_s=a.request_header_timeout,
    )


async def serve(config: RouterConfig) -> None:
    """Connect, warm up, then serve until uvicorn stops (SIGINT/SIGTERM)."""
    tokenizer = Tokenizer(config.tokenizer_name)
    client, shard, limits = await handshake(config)
    metrics = build_metrics(limits.max_input_tokens, limits.max_total_tokens)
    metrics.batch_max_total_tokens.set(limits.max_batch_total_tokens)
    metrics.layer_skip.set_policy(shard.layer_skip_policy_state, shard.layer_skip_mode)
    metrics.set_shard_memory(shard.memory)
    queue = Queue()
    health = Health()
    request_limits = Limits(
        max_best_of=config.max_best_of, max_stop_sequences=config.max_stop_sequences,
        max_top_n_tokens=config.max_top_n_tokens, serving=limits,
        disable_grammar_support=config.disable_grammar_support,
    )
    infer = Infer(tokenizer, queue, request_limits, metrics, config.max_concurrent_requests,
                  config.validation_workers, client.prepare_grammar)
    state = AppState(config, limits, shard, client, tokenizer, infer, metrics, health, RouterEnv.read())
    batcher = Batcher(client, queue, shard, limits, metrics, health,
                      (config.waiting_served_ratio, config.max_waiting_tokens, config.max_batch_size))
    app = build_app(state, batcher)
    drain = Drain(infer, batcher, config.graceful_termination_timeout_s)
    server = GracefulServer(
        server_config(app, config.hostname, config.port, config.graceful_termination_timeout_s,
                      config.request_header_timeout_s),
        drain, asyncio.get_running_loop(),
    )
    metrics_server = await serve_metrics(metrics, config.hostname, config.prometheus_port)
    logger.info("Connected; serving on {}:{}", config.hostname, config.port)
    try:
        await server.serve()
    finally:
        if metrics_server is not None:
            metrics_server.close()
        await client.close()


def main(argv: list[str] | None = None) -> None:
    try:
        config = config_from_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    if config.json_output:
        logger.remove()
        logger.add(sys.stdout, serialize=True)
    try:
        asyncio.run(serve(config))
    except (RuntimeError, ValueError) as err:
        logger.error("Router failed to start: {}", err)
        raise SystemExit(1) from err


if __name__ == "__main__":
    main()
