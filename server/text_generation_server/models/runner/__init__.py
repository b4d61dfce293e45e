"""Model runners: one forward pass over a left-padded batch with a dense KV cache.

`build_runner(model, kind)` picks the runner for a loaded transformers model:
- "auto": the fast runner when it supports the architecture, else the transformers fallback;
- "fast": the fast runner, or a ValueError naming the model_type it does not support;
- "transformers": always the fallback.
"""

from __future__ import annotations

from typing import Any

from loguru import logger

from . import cpu_kernels
from .base import ForwardInputs, LayerPath, Model, Runner
from .fast_llama import FastLlamaRunner, FastRunnerConfig
from .fast_weights import FAST_MODEL_TYPES, unsupported_reason
from .kv_cache import KVCache
from .transformers_runner import TransformersRunner

RUNNER_KINDS = ("auto", "fast", "transformers")

__all__ = ["FAST_MODEL_TYPES", "RUNNER_KINDS", "FastLlamaRunner", "FastRunnerConfig", "ForwardInputs", "KVCache",
           "LayerPath", "Model", "Runner",
           "TransformersRunner", "build_runner", "cpu_kernels"]


def build_runner(model: Any, kind: str = "auto", config: FastRunnerConfig | None = None) -> Runner:
    """The runner of `kind` for `model` (see module docstring); `config` tunes the fast one."""
    if kind not in RUNNER_KINDS:
        raise ValueError(f"--runner {kind} is not a known runner; use one of {', '.join(RUNNER_KINDS)}")
    if kind == "transformers":
        return TransformersRunner(model)  # type: ignore[arg-type]
    reason = unsupported_reason(model)
    if reason is not None:
        if kind == "fast":
            raise ValueError(f"the fast runner cannot run this model: {reason}; use --runner transformers or auto")
        logger.info(f"Using the transformers runner: {reason}")
        return TransformersRunner(model)  # type: ignore[arg-type]
    runner = FastLlamaRunner(model, config or FastRunnerConfig())
    logger.info(f"Using the {runner.name} runner ({runner.dtype})")
    return runner
