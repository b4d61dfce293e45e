"""Layer skipping in the shard, in-process: modes off, shadow and lossy, plan groups, the graceful
bypass. The tests drive `CausalLM` directly (to count executed layers and measure KV bytes);
integration-tests/server/test_layer_skip_process.py starts real shard processes (Info, refusal).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.skip_planner import LayerSkipConfig, SkipPlanner
from text_generation_server.layerskip import (
    IdentityMap,
    Policy,
    Rule,
    RuleTable,
    bypassed,
    find_decoder_layers,
    save_policy,
)
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.models.runner import FastRunnerConfig, ForwardInputs, build_runner
from text_generation_server.pb import generate_pb2

from factories import decode_in_process, make_batch, make_request
from policies import LONG_PROMPT, SHORT_PROMPT, SHORT_PROMPT_TOKENS, SIX_LAYERS, TWO_LAYERS, write_policy


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    return load_model(model_path, LoadConfig())


@pytest.fixture(scope="module")
def policy_path(hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_policy(hf_model, tmp_path_factory.mktemp("policy") / "policy.json", SIX_LAYERS, TWO_LAYERS)


def make_lm(model_path: Path, hf_model: torch.nn.Module, mode: str, policy: Path | None,
            runner_config: FastRunnerConfig | None = None) -> CausalLM:
    tokenizer = load_tokenizer(model_path)
    planner = SkipPlanner(hf_model, LayerSkipConfig(mode, str(policy) if policy else None))
    return CausalLM(build_runner(hf_model, "fast", runner_config), tokenizer, frozenset({tokenizer.eos_token_id}),
                    planner)


class LayerCounter:
    """Counts which decoder layers the fast runner executes (wraps its per-layer step)."""

    def __init__(self, lm: CausalLM) -> None:
        self.counts: Counter[int] = Counter()
        runner = lm.runner
        original = runner._layer  # type: ignore[attr-defined]

        def counting(index: int, *args: object) -> torch.Tensor:
            self.counts[index] += 1
            return original(index, *args)  # type: ignore[no-any-return]

        runner._layer = counting  # type: ignore[attr-defined]


def run(lm: CausalLM, requests: list[generate_pb2.Request]) -> tuple[dict[int, list[int]], dict[int, list[float]],
                                                                     CausalLMBatch, dict[int, object]]:
    """Prefill and decode to completion in-process; returns token ids, logprobs, the last batch, reports."""
    out = decode_in_process(lm, CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers,
                                                      lm.eos_token_ids, 1000))
    return out.tokens, out.logprobs, out.last, dict(out.reports)


@pytest.fixture(scope="module")
def off_lm(model_path: Path, hf_model: torch.nn.Module) -> CausalLM:
    return make_lm(model_path, hf_model, "off", None)


@pytest.fixture(scope="module")
def lossy_lm(model_path: Path, hf_model: torch.nn.Module, policy_path: Path) -> Iterator[CausalLM]:
    yield make_lm(model_path, hf_model, "lossy", policy_path)


def test_empty_plan_is_bit_identical_to_off(model_path: Path, hf_model: torch.nn.Module, off_lm: CausalLM,
                                             tmp_path: Path) -> None:
    empty_policy = write_policy(hf_model, tmp_path / "empty.json", frozenset())
    lossy_empty = make_lm(model_path, hf_model, "lossy", empty_policy)
    requests = [make_request(1, LONG_PROMPT, 10)]
    off_tokens, off_logprobs, _, _ = run(off_lm, requests)
    tokens, logprobs, _, reports = run(lossy_empty, requests)
    assert tokens == off_tokens and logprobs == off_logprobs  # exact float equality
    assert reports[1].mode == "lossy" and reports[1].skipped_layers == []  # type: ignore[attr-defined]


def test_shadow_reports_the_plan_and_changes_nothing(model_path: Path, hf_model: torch.nn.Module,
                                                     off_lm: CausalLM, policy_path: Path) -> None:
    shadow = make_lm(model_path, hf_model, "shadow", policy_path)
    counter = LayerCounter(shadow)
    requests = [make_request(1, LONG_PROMPT, 10), make_request(2, SHORT_PROMPT, 10)]
    off_tokens, off_logprobs, _, _ = run(off_lm, requests)
    tokens, logprobs, _, reports = run(shadow, requests)
    assert tokens == off_tokens and logprobs == off_logprobs
    assert reports[1].skipped_layers == sorted(SIX_LAYERS) and reports[1].rule == "default"  # type: ignore[attr-defined]
    assert reports[2].skipped_layers == sorted(TWO_LAYERS) and reports[2].rule == "short"  # type: ignore[attr-defined]
    assert set(counter.counts) == set(range(30))  # every layer ran


def test_lossy_skips_layers_and_their_kv_cache(off_lm: CausalLM, lossy_lm: CausalLM) -> None:
    counter = LayerCounter(lossy_lm)
    requests = [make_request(1, LONG_PROMPT, 6, ignore_eos=True)]
    _, _, off_batch, _ = run(off_lm, requests)
    tokens, _, lossy_batch, reports = run(lossy_lm, requests)
    assert len(tokens[1]) == 6 and reports[1].skipped_layers == sorted(SIX_LAYERS)  # type: ignore[attr-defined]
    assert set(counter.counts) == set(range(30)) - SIX_LAYERS  # skipped layers never executed
    assert all(counter.counts[i] == 6 for i in counter.counts)  # 1 prefill + 5 decode forwards
    (group,) = lossy_batch.groups
    assert group.skip == SIX_LAYERS
    pool = group.cache.pool  # the skip set's own: its bypassed layers hold no slots
    assert all(pool.keys[i] is None and pool.values[i] is None for i in SIX_LAYERS)
    off_bytes, lossy_bytes = off_batch.groups[0].cache.nbytes(), group.cache.nbytes()
    print(f"\nKV bytes: off {off_bytes}, lossy (6 of 30 skipped) {lossy_bytes} ({lossy_bytes / off_bytes:.2f}x)")
    assert lossy_bytes == off_bytes * 24 // 30


def test_mixed_plan_batch_equals_each_request_alone(off_lm: CausalLM, lossy_lm: CausalLM) -> None:
    requests = [
        make_request(1, LONG_PROMPT, 8),  # default rule: six layers
        make_request(2, SHORT_PROMPT, 8),  # short rule: two layers
        make_request(3, LONG_PROMPT + " Be brief.", 8),  # default rule again: same group as 1
    ]
    off_override = make_request(4, SHORT_PROMPT, 8)
    off_override.layer_skip_mode = "off"  # a per-request override: its own, empty skip set
    requests.append(off_override)
    alone = {r.id: run(lossy_lm, [r])[0][r.id] for r in requests}
    tokens, _, batch, reports = run(lossy_lm, requests)
    assert sorted(sorted(g.request_ids) for g in batch.groups) == [[1, 3], [2], [4]]
    assert 4 not in reports
    assert len(lossy_lm.tokenizer(SHORT_PROMPT)["input_ids"]) < SHORT_PROMPT_TOKENS
    for rid, expected in alone.items():
        assert tokens[rid] == expected, f"request {rid} differs inside the mixed batch"
    assert tokens[4] == run(off_lm, [off_override])[0][4]


def test_filter_and_concatenate_keep_groups_consistent(lossy_lm: CausalLM) -> None:
    first = CausalLMBatch.from_pb(make_batch(1, [make_request(1, LONG_PROMPT, 20), make_request(2, SHORT_PROMPT, 20)]),
                                  lossy_lm.tokenizer, 30, lossy_lm.eos_token_ids, 1000)
    second = CausalLMBatch.from_pb(make_batch(2, [make_request(3, SHORT_PROMPT + "!", 20)]),
                                   lossy_lm.tokenizer, 30, lossy_lm.eos_token_ids, 1000)
    _, first_next, _ = lossy_lm.generate_token(first)
    _, second_next, _ = lossy_lm.generate_token(second)
    assert first_next is not None and second_next is not None
    merged = CausalLMBatch.concatenate([first_next, second_next])
    assert merged.batch_id == 1 and [s.id for s in merged.requests] == [1, 2, 3]
    assert sorted(sorted(g.request_ids) for g in merged.groups) == [[1], [2, 3]]  # short prompts share a group
    merged.filter([3, 1])
    assert [s.id for s in merged.requests] == [3, 1]
    assert sorted(sorted(g.request_ids) for g in merged.groups) == [[1], [3]]
    generations, after, _ = lossy_lm.generate_token(merged)
    assert [g.request_id for g in generations] == [3, 1] and after is not None


def test_graceful_bypass_adds_the_policy_biases(model_path: Path, hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """The shard's graceful bypass equals the library's reference executor on the transformers model."""
    identity = IdentityMap.from_model(hf_model)
    table = RuleTable((), Rule("default", (), SIX_LAYERS), identity.num_layers)
    generator = torch.Generator().manual_seed(0)
    biases = {i: 0.05 * torch.randn(576, generator=generator) for i in SIX_LAYERS}
    policy = save_policy(Policy.from_table(identity, table, bypass="graceful"), tmp_path / "graceful.json", biases)
    lm = make_lm(model_path, hf_model, "lossy", policy)
    assert set(lm.planner.biases) == SIX_LAYERS
    ids = lm.tokenizer(LONG_PROMPT)["input_ids"]
    inputs = ForwardInputs.contiguous(torch.tensor([ids]))
    shard_logits = lm.runner.bypassing(SIX_LAYERS, lm.planner.biases).forward(inputs, lm.runner.new_cache(1))[0, -1]
    with torch.no_grad(), bypassed(find_decoder_layers(hf_model).modules, SIX_LAYERS, biases):
        reference = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
    strict = lm.runner.bypassing(SIX_LAYERS).forward(inputs, lm.runner.new_cache(1))[0, -1]
    torch.testing.assert_close(shard_logits, reference.float(), atol=1e-4, rtol=1e-4)
    assert float((shard_logits - strict).abs().max()) > 1e-2  # the biases really were added
