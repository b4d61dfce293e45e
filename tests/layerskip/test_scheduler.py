"""The library API on the real default model loaded with plain transformers (float32 and nf4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from text_generation_server.layerskip import (
    Condition,
    IdentityMap,
    Policy,
    Rule,
    RuleTable,
    Scheduler,
    SkipPlan,
    save_policy,
)

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
SKIP = frozenset({9, 17})


def _policy_file(identity: IdentityMap, directory: Path) -> Path:
    table = RuleTable((Rule("short-prompts", (Condition("num_tokens", "<", 64),), SKIP),), Rule("default"), 30)
    return save_policy(Policy.from_table(identity, table), directory / "policy.json")


@pytest.fixture(scope="module", params=["float32", "nf4"])
def scheduler(request: pytest.FixtureRequest, real_models: dict[str, PreTrainedModel],
              real_identities: dict[str, IdentityMap], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    path = _policy_file(real_identities["float32"], tmp_path_factory.mktemp("policy"))
    yield Scheduler.from_model(real_models[request.param], path, mode="lossy")


def test_plan_and_bitmask(scheduler: Scheduler) -> None:
    plan = scheduler.plan(PROMPT_IDS)
    assert (plan.mode, plan.rule, plan.skipped) == ("lossy", "short-prompts", SKIP)
    mask = scheduler.bitmask(torch.tensor([PROMPT_IDS]))
    assert mask.dtype == np.int32 and mask.shape == (30,)
    assert set(np.flatnonzero(mask == 0)) == set(SKIP)
    assert scheduler.bitmask(PROMPT_IDS, mode="shadow").min() == 1
    assert scheduler.plan(PROMPT_IDS, mode="shadow").skipped == SKIP


def test_plan_batch_equals_planning_each_prompt_alone(scheduler: Scheduler) -> None:
    other = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    ids = torch.zeros(2, len(other), dtype=torch.long)
    mask = torch.zeros(2, len(other), dtype=torch.long)
    ids[0, -len(PROMPT_IDS):], mask[0, -len(PROMPT_IDS):] = torch.tensor(PROMPT_IDS), 1  # left padded
    ids[1], mask[1] = torch.tensor(other), 1
    assert scheduler.plan_batch(ids, mask) == [scheduler.plan(PROMPT_IDS), scheduler.plan(other)]


def test_empty_plan_is_bit_identical_to_the_full_forward(scheduler: Scheduler) -> None:
    report = scheduler.verify_consistency(PROMPT_IDS, SkipPlan(), max_new_tokens=1)
    assert report.logits_max_abs_diff == 0.0 and report.kl_divergence == 0.0 and report.tokens_equal


def _count_mlp_calls(layers: nn.ModuleList) -> tuple[list[int], list[torch.utils.hooks.RemovableHandle]]:
    calls = [0] * len(layers)
    handles = []
    for index, layer in enumerate(layers):
        def hook(module: nn.Module, args: object, index: int = index) -> None:
            calls[index] += 1
        handles.append(layer.mlp.register_forward_pre_hook(hook))
    return calls, handles


def test_skipped_layers_do_not_run_and_are_restored(scheduler: Scheduler) -> None:
    layers = scheduler.layers.modules
    calls, handles = _count_mlp_calls(layers)
    try:
        plan = scheduler.plan(PROMPT_IDS)
        report = scheduler.verify_consistency(PROMPT_IDS, plan, max_new_tokens=2)
    finally:
        for handle in handles:
            handle.remove()
    print(f"\n[layerskip] skip {sorted(SKIP)}: logits max|diff| {report.logits_max_abs_diff:.3f}, "
          f"KL {report.kl_divergence:.4f}, greedy {report.full_tokens} vs {report.skip_tokens}")
    assert report.skipped == tuple(sorted(SKIP))
    assert [calls[i] for i in sorted(SKIP)] == [2, 2]  # only the full forwards ran them
    assert all(calls[i] == 4 for i in range(30) if i not in SKIP)
    assert report.logits_max_abs_diff > 0.0 and report.kl_divergence > 0.0
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_refused_policy_raises_and_names_the_file(real_models: dict[str, PreTrainedModel], tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=f"policy file {path} is corrupt"):
        Scheduler.from_model(real_models["float32"], path)


def test_without_a_policy_nothing_is_skipped(real_models: dict[str, PreTrainedModel]) -> None:
    scheduler = Scheduler.from_model(real_models["float32"])
    assert scheduler.plan(PROMPT_IDS).skipped == frozenset()
    assert scheduler.bitmask(PROMPT_IDS).tolist() == [1] * 30
    with pytest.raises(ValueError, match="one prompt's integer ids"):
        scheduler.plan(torch.zeros(2, 3, dtype=torch.long))
