"""Flags of `text-generation-launcher`: upstream names and defaults, SCREAMING_SNAKE env
equivalents (docs/tgi-interface.md §3.1), and the upstream flags this backend refuses by name."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from text_generation_router.env import LauncherEnv
from text_generation_router.layer_skip import LAYER_SKIP_MODES, LayerSkipMode

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Upstream flags that have no meaning on this backend, with what to do instead.
REFUSED = {
    "--kv-cache-dtype": "fp8 KV caches are not supported on this backend",
    "--cuda-graphs": "CUDA graphs are not used by this backend",
    "--cuda-memory-fraction": "this backend does not reserve a CUDA memory fraction",
    "--lora-adapters": "LoRA adapters are not supported",
    "--rope-scaling": "RoPE scaling overrides are not supported",
    "--rope-factor": "RoPE scaling overrides are not supported",
    "--tokenizer-config-path": "the tokenizer config is read from the model folder",
    "--weights-cache-override": "weights are resolved by `text-generation-server download-weights`",
    "--disable-custom-kernels": "this backend has no custom kernels",
    "--ngrok": "ngrok tunnels are not supported",
    "--ngrok-authtoken": "ngrok tunnels are not supported",
    "--ngrok-edge": "ngrok tunnels are not supported",
    "--env": "print your environment with `env` instead",
    "--max-client-batch-size-per-prompt": "unknown upstream option",
}


def build_parser(env: LauncherEnv) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="text-generation-launcher")
    p.add_argument("--model-id", default=env.text("MODEL_ID", DEFAULT_MODEL_ID))
    p.add_argument("--revision", default=env.text("REVISION", None))
    p.add_argument("--quantize", default=env.text("QUANTIZE", None), choices=[
        "awq", "compressed-tensors", "eetq", "exl2", "gptq", "marlin", "bitsandbytes",
        "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8"])
    p.add_argument("--dtype", default=env.text("DTYPE", None), choices=["float16", "bfloat16", "float32"])
    # Upstream's n-gram speculation: up to N draft tokens per step (Medusa heads are not supported).
    p.add_argument("--speculate", type=int, default=env.integer("SPECULATE", None))
    p.add_argument("--trust-remote-code", action="store_true", default=env.flag("TRUST_REMOTE_CODE"))
    p.add_argument("--num-shard", type=int, default=env.integer("NUM_SHARD", None))
    p.add_argument("--sharded", default=env.text("SHARDED", None), choices=["true", "false"])
    ints: list[tuple[str, int | None]] = [
        ("max-input-tokens", None), ("max-input-length", None), ("max-total-tokens", None),
        ("max-batch-prefill-tokens", None), ("max-batch-total-tokens", None),
        ("max-batch-size", None), ("max-concurrent-requests", 128), ("max-best-of", 2),
        ("max-stop-sequences", 4), ("max-top-n-tokens", 5), ("max-waiting-tokens", 20),
        ("port", 3000), ("prometheus-port", 9000), ("master-port", 29500),
        ("validation-workers", 2), ("max-client-batch-size", 4), ("payload-limit", 2_000_000),
        ("graceful-termination-timeout", 90),
    ]
    for name, default in ints:
        p.add_argument(f"--{name}", type=int, default=env.integer(name.upper().replace("-", "_"), default))
    p.add_argument("--waiting-served-ratio", type=float,
                   default=float(env.text("WAITING_SERVED_RATIO", "0.3") or 0.3))
    p.add_argument("--hostname", default=env.hostname())
    p.add_argument("--shard-uds-path", default=env.text("SHARD_UDS_PATH", "/tmp/text-generation-server"))
    p.add_argument("--master-addr", default=env.text("MASTER_ADDR", "localhost"))
    p.add_argument("--api-key", default=env.text("API_KEY", None))
    p.add_argument("--cors-allow-origin", action="append",
                   default=[o for o in (env.text("CORS_ALLOW_ORIGIN", "") or "").split(",") if o])
    p.add_argument("--json-output", action="store_true", default=env.flag("JSON_OUTPUT"))
    p.add_argument("--grammar-compile-timeout", type=float, default=env.number("GRAMMAR_COMPILE_TIMEOUT", 5.0),
                   help="seconds a request's grammar may compile before it is refused (422)")
    p.add_argument("--disable-grammar-support", action="store_true",
                   default=env.flag("DISABLE_GRAMMAR_SUPPORT"))
    p.add_argument("--enable-prefill-logprobs", action="store_true",
                   default=env.flag("ENABLE_PREFILL_LOGPROBS"))
    p.add_argument("--otlp-endpoint", default=env.text("OTLP_ENDPOINT", None))
    p.add_argument("--otlp-service-name", default=env.text("OTLP_SERVICE_NAME", "text-generation-inference.router"))
    p.add_argument("--usage-stats", default=env.text("USAGE_STATS", "on"), choices=["on", "off", "no-stack"])
    p.add_argument("--huggingface-hub-cache", default=env.text("HUGGINGFACE_HUB_CACHE", None))
    p.add_argument("--watermark-gamma", type=float, default=env.number("WATERMARK_GAMMA"))
    p.add_argument("--watermark-delta", type=float, default=env.number("WATERMARK_DELTA"))
    p.add_argument("--served-model-name", default=env.text("SERVED_MODEL_NAME", None))
    # Extensions of this fork, passed to the shard.
    p.add_argument("--runner", default=env.text("RUNNER", "auto"), choices=["auto", "fast", "transformers"])
    p.add_argument("--layer-skip-mode", default=env.text("LAYER_SKIP_MODE", LayerSkipMode.OFF.value),
                   choices=LAYER_SKIP_MODES)
    p.add_argument("--layer-skip-policy", default=env.text("LAYER_SKIP_POLICY", None))
    p.add_argument("--layer-skip-on-bad-policy", default=env.text("LAYER_SKIP_ON_BAD_POLICY", "exit"),
                   choices=["exit", "off"])
    for flag in REFUSED:
        p.add_argument(flag, nargs="?", const="", default=None, help=argparse.SUPPRESS)
    return p


@dataclass(frozen=True)
class LauncherArgs:
    """Parsed flags; `ns` keeps every value under its argparse name, `env` the environment
    they were read with (the children inherit it)."""

    ns: argparse.Namespace
    env: LauncherEnv

    def __post_init__(self) -> None:
        a = self.ns
        for flag, reason in REFUSED.items():
            if getattr(a, flag[2:].replace("-", "_")) is not None:
                raise ValueError(f"{flag} is not supported by this launcher: {reason}")
        if a.num_shard not in (None, 1) or a.sharded == "true":
            raise ValueError("--num-shard/--sharded: this backend runs exactly one shard")
        if a.max_input_tokens is not None and a.max_input_length is not None:
            raise ValueError("set --max-input-tokens or its legacy name --max-input-length, not both")
        max_input = a.max_input_tokens if a.max_input_tokens is not None else a.max_input_length
        if max_input is not None and a.max_total_tokens is not None and max_input >= a.max_total_tokens:
            raise ValueError(
                f"`max_input_tokens` ({max_input}) must be < `max_total_tokens` ({a.max_total_tokens})"
            )
        if a.speculate is not None and a.speculate < 1:
            raise ValueError(f"--speculate {a.speculate}: use a positive number of draft tokens per step")
        if a.validation_workers <= 0:
            raise ValueError("--validation-workers must be > 0")
        if a.watermark_gamma is not None and not 0.0 < a.watermark_gamma < 1.0:
            raise ValueError(f"--watermark-gamma {a.watermark_gamma} must be in (0, 1)")
        if a.watermark_delta is not None and not a.watermark_delta > 0.0:
            raise ValueError(f"--watermark-delta {a.watermark_delta} must be positive")

    @property
    def max_input_tokens(self) -> int | None:
        value: int | None = self.ns.max_input_tokens
        return value if value is not None else self.ns.max_input_length

    def max_batch_prefill_tokens(self) -> int:
        """Upstream's default is 4096 (without a known GPU), at least max_input_tokens."""
        if self.ns.max_batch_prefill_tokens is not None:
            return int(self.ns.max_batch_prefill_tokens)
        return max(4096, (self.max_input_tokens or 0))


def parse_args(argv: list[str] | None = None, env: LauncherEnv | None = None) -> LauncherArgs:
    """The flags in argv (default sys.argv), defaulted from env (default: this process's)."""
    env = env or LauncherEnv.read()
    return LauncherArgs(build_parser(env).parse_args(argv), env)
