"""The shard's memory account (engine/memory.py) on the real default model: every weight counted
once under its part, the KV of a live batch and the prefix cache exactly, the rest of resident
memory as `other`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_layer_skip_shard import make_lm

from text_generation_server.engine import memory
from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.prefix_cache import PrefixCache

from factories import make_batch, make_request
from prompt_sets import LONG


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    from text_generation_server.models.loading import LoadConfig, load_model

    return load_model(model_path, LoadConfig())


@pytest.fixture(scope="module")
def lm(model_path: Path, hf_model: torch.nn.Module) -> CausalLM:
    return make_lm(model_path, hf_model, "off", None)


def test_storage_bytes_counts_a_storage_once_and_follows_objects() -> None:
    base = torch.zeros(1000)  # 4,000 bytes
    holder = type("Holder", (), {})()
    holder.views = [base[:10], base[500:]]  # type: ignore[attr-defined]
    counted: set[int] = set()
    assert memory.storage_bytes({"a": (holder, base)}, counted) == 4000
    assert memory.storage_bytes([base.view(10, 100)], counted) == 0  # already counted
    assert memory.storage_bytes([torch.ones(3, dtype=torch.int8)], counted) == 3


def test_the_account_of_a_loaded_model_with_a_live_batch_and_a_prefix_cache(lm: CausalLM,
                                                                             hf_model: torch.nn.Module) -> None:
    empty = lm.memory()
    # SmolLM2's lm_head is tied to the embeddings: counted once, as embeddings.
    embed = lm.runner.embed  # type: ignore[attr-defined]
    assert empty["embeddings"] == embed.numel() * embed.element_size()
    assert empty["lm_head"] == 0
    # every decoder layer's projections (q, k, v, o, gate, up, down) at least once
    layers = hf_model.model.layers  # type: ignore[union-attr]
    projections = sum(p.numel() for p in layers[0].parameters() if p.dim() == 2) * embed.element_size()
    assert empty["layers"] >= len(layers) * projections
    assert empty["kv"] == 0 and empty["prefix_cache"] == 0
    assert empty["resident"] >= sum(v for k, v in empty.items() if k not in ("resident", "peak", "other"))
    assert empty["peak"] >= empty["resident"] and empty["other"] > 0

    batch = CausalLMBatch.from_pb(make_batch(1, [make_request(0, LONG[0], 4)]),
                                  lm.tokenizer, lm.runner.num_layers, lm.eos_token_ids, 1000)
    lm.prefixes = PrefixCache(64 << 20)
    try:
        lm.generate_token(batch)
        live = lm.memory()
        (group,) = batch.groups
        pool = lm.pools(group.skip)
        assert live["kv"] == lm.pools.nbytes() == pool.nbytes() > 0  # the pool's slots, used or free
        assert 0 < group.cache.nbytes() == group.cache.blocks() * pool.block_bytes() <= live["kv"]
        assert live["prefix_cache"] == lm.prefixes.nbytes > 0  # the prompt was kept after prefill
        assert live["embeddings"] == empty["embeddings"] and live["layers"] == empty["layers"]
        serving = memory.serving(lm.pools, lm.prefixes)
        assert serving["kv"] == live["kv"] and serving["prefix_cache"] == live["prefix_cache"]
        assert serving["kv_used"] == group.cache.nbytes()  # the only batch holds every block in use
        assert serving["peak"] >= serving["resident"] > 0
    finally:
        lm.prefixes = None
