"""Assemble the served model: weights -> loaded model -> skip planner and runner -> CausalLM."""

from __future__ import annotations

from pathlib import Path

from loguru import logger
from transformers import GenerationConfig

from ..download import download_weights
from ..models.loading import LoadConfig, load_model, load_tokenizer
from ..models.runner import FastRunnerConfig, build_runner
from ..speculative.controller import SpeculateConfig
from .causal_lm import CausalLM
from .memory import loading_heap
from .skip_planner import LayerSkipConfig, SkipPlanner


def eos_token_ids(path: Path, tokenizer_eos: int | None) -> frozenset[int]:
    """The EOS set: the tokenizer's EOS plus the generation config's (which may be a list)."""
    ids: set[int] = set() if tokenizer_eos is None else {tokenizer_eos}
    try:
        generation = GenerationConfig.from_pretrained(str(path))
    except OSError:
        return frozenset(ids)
    eos = generation.eos_token_id
    ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return frozenset(ids)


def get_model(model_id: str, revision: str | None, load: LoadConfig, runner_kind: str = "auto",
              layer_skip: LayerSkipConfig | None = None, speculation: SpeculateConfig | None = None) -> CausalLM:
    path = download_weights(model_id, revision)
    tokenizer = load_tokenizer(path, load.trust_remote_code)
    with loading_heap():
        model = load_model(path, load, defer_tables=True)
        planner = SkipPlanner(model, layer_skip or LayerSkipConfig())
        runner = build_runner(model, runner_kind, FastRunnerConfig(release_model=True))  # the model goes below
        mapped = runner.checkpoint_embeddings()
        if mapped is not None:
            planner.scheduler.detach_model(mapped)
            logger.info(f"Input embeddings read from the checkpoint per lookup ({mapped.source} rows cast to "
                        f"{mapped.dtype}); no table is held")
        logger.info(f"Runner: {runner.name} ({model.config.model_type}, {runner.num_layers} layers, {runner.dtype})")
        max_positions = int(getattr(model.config.get_text_config(), "max_position_embeddings", 4096))
        del model  # the runner and the planner keep what they read
    return CausalLM(runner, tokenizer, eos_token_ids(path, tokenizer.eos_token_id), planner, max_positions,
                    speculation)
