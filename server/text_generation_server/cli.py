"""`text-generation-server`: the shard's command line, with upstream TGI's commands and options.

Upstream's launcher calls `download-weights MODEL --extension .safetensors --logger-level L
--json-output` and then `serve MODEL --uds-path P --logger-level L --json-output ...`; both
keep upstream's option names so the upstream launcher can drive this shard unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from enum import Enum
from typing import TYPE_CHECKING, Optional

import typer
from loguru import logger

from .grammar_limits import GrammarLimits
from .layerskip import LayerSkipMode

if TYPE_CHECKING:
    from .engine.causal_lm import CausalLM
    from .engine.skip_planner import LayerSkipConfig
    from .server import ServeConfig

app = typer.Typer(add_completion=False, help="A TGI v3 shard with input-adaptive layer skipping.")


class Quantization(str, Enum):
    bitsandbytes = "bitsandbytes"
    bitsandbytes_nf4 = "bitsandbytes-nf4"
    bitsandbytes_fp4 = "bitsandbytes-fp4"
    gptq = "gptq"
    awq = "awq"
    compressed_tensors = "compressed-tensors"
    eetq = "eetq"
    exl2 = "exl2"
    fp8 = "fp8"
    marlin = "marlin"


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class KVCacheDtype(str, Enum):
    fp8_e4m3fn = "fp8_e4m3fn"
    fp8_e5m2 = "fp8_e5m2"


def setup_logging(level: str, json_output: bool) -> None:
    """Loguru to stdout; with --json-output one serialized record per line, the shape upstream's
    launcher parses (`{"text": ..., "record": {"level": {"name": ...}}}`)."""
    logger.remove()
    logger.add(sys.stdout, level=level.upper(), serialize=json_output, backtrace=False, diagnose=False)


@app.command("download-weights")
def download_weights_command(
    model_id: str,
    revision: Optional[str] = None,  # noqa: UP045 - typer needs Optional on Python 3.10
    extension: str = ".safetensors",
    auto_convert: bool = True,
    logger_level: str = "INFO",
    json_output: bool = False,
    trust_remote_code: bool = False,
    merge_lora: bool = False,
) -> None:
    """Make MODEL_ID's weights available locally (a local folder passes through)."""
    from .download import download_weights

    setup_logging(logger_level, json_output)
    if extension != ".safetensors":
        logger.error(f"--extension {extension}: only .safetensors checkpoints are served")
        raise typer.Exit(1)
    try:
        path = download_weights(model_id, revision)
    except ValueError as err:
        logger.error(str(err))
        raise typer.Exit(1) from err
    logger.info(f"Weights of {model_id} are at {path}")
    # The last stdout line, for tools that need the local folder (our launcher reads it).
    print(json.dumps({"local_path": str(path)}), flush=True)


@app.command("build-kernels")
def build_kernels_command() -> None:
    """Compile every ISA variant of the fast runner's CPU kernels into TGI_KERNEL_DIR now.

    Compiling runs none of what it compiles, so it needs a C++ compiler, not a particular CPU:
    an image built on one host runs on another, which imports the variant its CPU can run.
    Then, on this CPU, the runnable variants are timed per weight kind and the fastest of each
    is remembered (kernel_choice.py; every server process here reads that choice). Exits 1 when
    the compiler is missing or fails (serving would then use torch's ops).
    """
    from .models.runner import cpu_kernels, kernel_choice

    try:
        folder = cpu_kernels.build()
        choice = cpu_kernels.chosen()
        used = f"none used here: {choice}" if isinstance(choice, str) else ""
        if not isinstance(choice, str):  # imports each variant it uses, and measures which is fastest
            picks = {kind: cpu_kernels.load(kind=kind) for kind in kernel_choice.KINDS}
            used = "this machine uses " + ", ".join(f"{ops.variant} for {kind}" for kind, ops in picks.items() if ops)
            if not all(picks.values()):
                raise RuntimeError("a kernel variant failed to load (see the log)")
    except Exception as error:
        print(f"cpu kernels: build failed: {error}", file=sys.stderr)
        raise typer.Exit(1) from error
    names = ", ".join(variant.name for variant in cpu_kernels.built_variants())
    print(f"cpu kernels: built {names} in {folder} ({used})")


@app.command()
def serve(
    model_id: str,
    revision: Optional[str] = None,  # noqa: UP045
    sharded: bool = False,
    quantize: Optional[Quantization] = None,  # noqa: UP045
    speculate: Optional[int] = typer.Option(  # noqa: UP045
        None, help="n-gram (prompt-lookup) speculation: up to N draft tokens per step, verified losslessly"),
    dtype: Optional[Dtype] = None,  # noqa: UP045
    kv_cache_dtype: Optional[KVCacheDtype] = None,  # noqa: UP045
    trust_remote_code: bool = False,
    uds_path: str = "/tmp/text-generation-server",
    logger_level: str = "INFO",
    json_output: bool = False,
    otlp_endpoint: Optional[str] = None,  # noqa: UP045
    otlp_service_name: str = "text-generation-inference.server",
    max_input_tokens: Optional[int] = None,  # noqa: UP045
    runner: str = typer.Option("auto", help="auto | fast | transformers (force the fallback)"),
    layer_skip_mode: str = typer.Option(LayerSkipMode.OFF.value,
                                        help="default layer-skip mode: off | shadow | lossy | verified"),
    layer_skip_policy: Optional[str] = typer.Option(  # noqa: UP045
        None, help="layer-skip policy JSON file, or auto: the shipped policy whose fingerprints match the model"),
    layer_skip_on_bad_policy: str = typer.Option("exit", help="exit | off: what a refused policy does"),
    layer_skip_shadow_rate: float = typer.Option(0.0, help="fraction of greedy lossy requests re-run as off"),
    layer_skip_shadow_window: int = typer.Option(20, help="comparisons in the consistency window"),
    layer_skip_consistency_target: Optional[float] = typer.Option(  # noqa: UP045
        None, help="roll back below this ratio (default: the policy's calibrated consistency)"),
    grammar_compile_timeout: float = typer.Option(
        GrammarLimits.compile_timeout_s, help="seconds a grammar may compile before its requests are refused"),
) -> None:
    """Serve MODEL_ID over gRPC on the unix socket {uds_path}-{rank}."""
    from .engine.audit_check import AuditConfig
    from .engine.skip_planner import LayerSkipConfig
    from .env import ShardEnv

    setup_logging(logger_level, json_output)
    try:
        env = ShardEnv.read()  # before the model loads: a bad value is refused at once
        grammar_limits = GrammarLimits(compile_timeout_s=grammar_compile_timeout)
        model, config = _build(model_id, revision, sharded, quantize, speculate, dtype, kv_cache_dtype,
                               trust_remote_code, uds_path, max_input_tokens, runner,
                               LayerSkipConfig(layer_skip_mode, layer_skip_policy, layer_skip_on_bad_policy,
                                               AuditConfig(layer_skip_shadow_rate, layer_skip_shadow_window,
                                                            layer_skip_consistency_target)))
        config = dataclasses.replace(config, grammar_limits=grammar_limits)
        if env.prefix_caching and env.prefix_cache_mib:
            from .engine.prefix_cache import PrefixCache

            model.prefixes = PrefixCache(env.prefix_cache_mib << 20)
        model.prefill_chunk = env.prefill_chunk
        logger.info(f"Prefix cache: {f'up to {env.prefix_cache_mib} MiB' if model.prefixes else 'off'} "
                    f"(PREFIX_CACHING={int(env.prefix_caching)}, PREFIX_CACHE_MIB={env.prefix_cache_mib}); "
                    f"prefill in chunks of {env.prefill_chunk or 'unlimited'} tokens (PREFILL_CHUNK_TOKENS)")
    except ValueError as err:
        logger.error(str(err))
        raise typer.Exit(1) from err
    if otlp_endpoint:
        logger.warning(f"--otlp-endpoint {otlp_endpoint}: tracing export is not implemented; no spans are sent")
    from .server import serve_model

    asyncio.run(serve_model(model, config, env))


def _build(model_id: str, revision: str | None, sharded: bool, quantize: Quantization | None,
           speculate: int | None, dtype: Dtype | None, kv_cache_dtype: KVCacheDtype | None,
           trust_remote_code: bool, uds_path: str, max_input_tokens: int | None,
           runner: str, layer_skip: LayerSkipConfig) -> tuple[CausalLM, ServeConfig]:
    import torch

    from .engine import get_model
    from .models.loading import LoadConfig
    from .server import ServeConfig

    if sharded:
        raise ValueError("--sharded: this CPU backend runs one shard; drop --sharded / --num-shard")
    if kv_cache_dtype is not None:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype.value} is not supported on this backend")
    load = LoadConfig(quantize=quantize.value if quantize else None,
                      dtype=dtype.value if dtype else "float32", trust_remote_code=trust_remote_code)
    from .speculative.controller import SpeculateConfig

    model = get_model(model_id, revision, load, runner, layer_skip, SpeculateConfig(speculate))
    limit = max_input_tokens or model.max_position_embeddings - 1
    torch.set_grad_enabled(False)
    config = ServeConfig(uds_path=uds_path, max_input_tokens=limit, dtype=str(load.torch_dtype),
                         quantize=load.quantize or "")
    return model, config


from .layerskip_cli import app as layerskip_app  # noqa: E402  (offline layer-skip tools)

app.add_typer(layerskip_app, name="layerskip")


if __name__ == "__main__":
    app()
