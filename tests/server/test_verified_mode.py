"""Verified mode on the real default model: greedy and seeded output equals `off`, token for token.

Drafting is forced on for the whole run (`auto_off = False`), so every step is a real
draft-verify cycle; the policy drafts with 6 of 30 layers bypassed. float32 checks all 30
prompts of `prompt_sets.ALL`, bitsandbytes nf4 (with bitsandbytes' numerics, and with int8
activations: TGI_QUANTIZED_ACTIVATIONS=int8) and int8 every other one (all 30 with
TGI_FULL_EXACTNESS=1); all must match exactly. A divergence is printed with its position and
the full model's top-2 logit margin there.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_layer_skip_shard import make_lm, run

from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.layerskip import DraftSettings
from text_generation_server.models.loading import LoadConfig, load_model
from text_generation_server.models.runner import FastRunnerConfig
from text_generation_server.models.runner.base import ForwardInputs
from text_generation_server.models.runner.kv_cache import KVCache
from text_generation_server.speculative.cost_model import MAX_DRAFT, CostModel
from text_generation_server.speculative.tuning import DraftTuning

from factories import decode_in_process, make_batch, make_request
from policies import SIX_LAYERS, write_policy
from prompt_sets import ALL, chat_text

NEW_TOKENS = 64


def divergence(lm: CausalLM, prompt: str, expected: list[int], got: list[int]) -> str:
    """Where two greedy runs part, with the full model's top-2 logit margin there."""
    position = next(i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b)
    ids = lm.tokenizer(prompt)["input_ids"] + expected[:position]
    cache = lm.runner.new_cache(1)
    logits = lm.runner.forward(ForwardInputs.contiguous(torch.tensor([ids])), cache)[0, -1]
    top = torch.topk(logits, 2).values
    return (f"first divergence at token {position}: off {expected[position]}, verified {got[position]}, "
            f"top-2 logit margin {float(top[0] - top[1]):.2e}")


def multi_token_discrepancy(lm: CausalLM, prompt: str, k: int) -> float:
    """Max |logits| difference between one k-token forward and k one-token forwards of the same
    tokens: what verification can differ by from plain decoding, for numerical reasons alone."""
    ids = lm.tokenizer(prompt)["input_ids"]
    n = len(ids)
    cache = lm.runner.new_cache(1)
    lm.runner.forward(ForwardInputs.contiguous(torch.tensor([ids[: n - k]])), cache)
    start = cache.length
    multi = lm.runner.forward(ForwardInputs.contiguous(torch.tensor([ids[n - k:]]), n - k, last_only=False), cache)[0]
    cache.crop(start)
    single = torch.stack([lm.runner.forward(ForwardInputs.contiguous(torch.tensor([[ids[j]]]), j), cache)[0, -1]
                          for j in range(n - k, n)])
    return float((multi - single).abs().max())


PRECISIONS = {"fp32": None, "nf4": "bitsandbytes-nf4", "nf4-int8x": "bitsandbytes-nf4", "int8": "bitsandbytes"}
RUNNER_CONFIGS = {"nf4-int8x": FastRunnerConfig(quantized_activations="int8")}


class Pair:
    """An `off` and a `verified` CausalLM over one loaded model."""

    def __init__(self, model_path: Path, name: str, tmp: Path, every: int = 1) -> None:
        self.model_path, self.name = model_path, name
        self.model = model = load_model(model_path, LoadConfig(quantize=PRECISIONS[name]))
        self.policy = policy = write_policy(model, tmp / "policy.json", SIX_LAYERS)
        config = RUNNER_CONFIGS.get(name)
        self.off = make_lm(model_path, model, "off", None, config)
        self.verified = make_lm(model_path, model, "verified", policy, config)
        self.verified.auto_off = False
        self.prompts = {i: chat_text(self.off.tokenizer, p) for i, (_, p) in enumerate(ALL) if i % every == 0}
        self.expected = {i: run(self.off, [make_request(i, p, NEW_TOKENS)])[0][i] for i, p in self.prompts.items()}

    def check(self, tokens: dict[int, list[int]], expected: dict[int, list[int]] | None = None) -> None:
        """Tokens equal `off`'s (alone, unless `expected` says otherwise); each divergence is
        reported with the margin of `off` alone there."""
        expected = expected or self.expected
        failures = [f"prompt {i} ({ALL[i][0]}): {divergence(self.off, self.prompts[i], expected[i], got)}"
                    for i, got in tokens.items() if got != expected[i]]
        assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def pairs(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Pair]:
    """Each precision's Pair, made on first use and kept for this module."""

    @functools.cache
    def make(precision: str) -> Pair:
        every = 1 if precision == "fp32" or os.environ.get("TGI_FULL_EXACTNESS") == "1" else 2
        return Pair(model_path, precision, tmp_path_factory.mktemp(precision), every)

    return make


@pytest.fixture(scope="module", params=list(PRECISIONS))
def pair(request: pytest.FixtureRequest, pairs: Callable[[str], Pair]) -> Pair:
    return pairs(request.param)


@pytest.fixture(scope="module")
def fp32(pairs: Callable[[str], Pair]) -> Pair:
    return pairs("fp32")


def test_a_verification_forward_equals_its_one_token_steps(pair: Pair) -> None:
    """On the CPU kernels every product, norm and attention of a row is summed in one order
    whatever the rows beside it: bitsandbytes' 4-bit rows in the one-row order, LLM.int8()'s
    outlier columns decided per row. So the logits of a verification are its steps' bit for bit."""
    if pair.off.runner.dims.ops is None:  # type: ignore[attr-defined]
        pytest.skip("no CPU kernels here: torch's products differ by rounding")
    for k in (2, 5, 9, 16):
        assert multi_token_discrepancy(pair.off, pair.prompts[0], k) == 0.0, k


def test_greedy_verified_alone_equals_off(pair: Pair) -> None:
    assert len(pair.prompts) >= 15
    assert {ALL[i][0] for i in pair.prompts} == {"chat", "reasoning", "code", "greeting", "long"}
    tokens, drafted, accepted = {}, 0, 0
    for i, prompt in pair.prompts.items():
        out, _, _, reports = run(pair.verified, [make_request(i, prompt, NEW_TOKENS)])
        tokens[i] = out[i]
        drafted += int(reports[i].stats["drafted"])  # type: ignore[attr-defined]
        accepted += int(reports[i].stats["accepted"])  # type: ignore[attr-defined]
    print(f"\n{len(tokens)} prompts, {drafted} drafted, {accepted} accepted ({accepted / max(drafted, 1):.2f})")
    assert drafted > 0 and accepted > 0
    pair.check(tokens)


def test_greedy_verified_in_a_mixed_batch_equals_off(pair: Pair) -> None:
    """Verified rows beside `off` and `shadow` ones give what the same batch gives in mode `off`.
    (Left-padded beside longer prompts, a prompt's prefill attention runs over more columns on
    torch's SDPA and differs from its prefill alone by ~1e-5 in float32; LLM.int8() and int8
    activations round x to integers, so there such differences can move a token: int8 and
    nf4-int8x are compared with the batch only.)"""
    requests = []
    for i, prompt in pair.prompts.items():
        r = make_request(i, prompt, NEW_TOKENS)
        r.layer_skip_mode = "off" if i % 5 == 0 else ("shadow" if i % 5 == 1 else "")  # mixed modes
        requests.append(r)
    tokens, _, _, _ = run(pair.verified, requests)
    pair.check(tokens, run(pair.off, requests)[0])
    if pair.name not in ("int8", "nf4-int8x"):
        pair.check(tokens)


def test_int8_activations_serve_other_logits_close_to_bitsandbytes_numerics(pairs: Callable[[str], Pair]) -> None:
    """nf4-int8x runs the int8-activation products: its logits are not nf4's (other numerics) but
    stay near them (measured on prompt 0: 1.78 apart at most, logits up to 28, the greedy token
    unchanged; the int8 path computes the same on every kernel variant)."""
    nf4, int8x = pairs("nf4"), pairs("nf4-int8x")
    assert (nf4.off.runner.quantized_activations, int8x.off.runner.quantized_activations) == ("float", "int8")
    ids = torch.tensor([nf4.off.tokenizer(nf4.prompts[0])["input_ids"]])
    logits = [lm.runner.forward(ForwardInputs.contiguous(ids), lm.runner.new_cache(1))[0, -1]
              for lm in (nf4.off, int8x.off)]
    gap = float((logits[0] - logits[1]).abs().max())
    assert 0.0 < gap < 2.0, gap
    assert int(logits[0].argmax()) == int(logits[1].argmax())


def test_stop_sequence_and_length_inside_an_accepted_run(fp32: Pair) -> None:
    prompt = chat_text(fp32.off.tokenizer, "Hello")
    full = fp32.off.tokenizer.decode(fp32.expected[ALL.index(("greeting", "Hello"))])
    stop = full.split()[3]  # a word in the middle of the greeting's answer
    for kwargs in ({"stop": (stop,)}, {}):
        for max_new in (2, 5, 9):
            outcomes = []
            for lm in (fp32.off, fp32.verified):
                batch = CausalLMBatch.from_pb(make_batch(1, [make_request(1, prompt, max_new, **kwargs)]),  # type: ignore[arg-type]
                                              lm.tokenizer, 30, lm.eos_token_ids, 1000)
                out = decode_in_process(lm, batch)
                outcomes.append((out.tokens[1], out.finals.get(1)))
            assert outcomes[0] == outcomes[1], f"stop={kwargs} max_new_tokens={max_new}"


def test_seeded_verified_sampling_gives_off_s_tokens(pair: Pair) -> None:
    """A seeded sampled request gives `off`'s tokens in verified mode however its drafts went:
    alone, again (the rule's acceptance learnt from the first run changes the drafts), and beside
    a greedy request."""
    prompt = chat_text(pair.off.tokenizer, "Tell me a story about a dragon.")

    def sample(lm: CausalLM, seed: int, beside: str | None = None) -> tuple[list[int], float]:
        requests = [make_request(1, prompt, 24, do_sample=True, seed=seed, temperature=0.7, top_k=20)]
        if beside is not None:
            requests.append(make_request(2, beside, 24))
        tokens, _, _, reports = run(lm, requests)
        report = reports.get(1)  # verified mode reports its drafts; `off` reports nothing
        return tokens[1], report.stats["drafted"] if report is not None else 0  # type: ignore[attr-defined]

    off, _ = sample(pair.off, 11)
    first, again, batched = sample(pair.verified, 11), sample(pair.verified, 11), sample(pair.verified, 11,
                                                                                         pair.prompts[8])
    assert first[0] == off and again[0] == off and batched[0] == off
    assert first[1] > 0 and batched[1] > 0, (first, batched)  # drafts were made and verified
    assert sample(pair.off, 12)[0] != off


def test_cache_holds_exactly_the_accepted_tokens(fp32: Pair) -> None:
    """After verified steps with per-row rejections, each row's unmasked cache columns equal
    the cache `off` builds for the same tokens."""
    prompts = [fp32.prompts[0], fp32.prompts[8]]  # a chat question and a reasoning one
    batch = CausalLMBatch.from_pb(make_batch(1, [make_request(i, p, 24) for i, p in enumerate(prompts)]),
                                  fp32.verified.tokenizer, 30, fp32.verified.eos_token_ids, 1000)
    current: CausalLMBatch | None = batch
    for _ in range(4):
        assert current is not None
        _, current, _ = fp32.verified.generate_token(current)
    assert current is not None
    (group,) = current.groups
    assert group.skip == frozenset()  # verified rows cache every layer
    for row, state in enumerate(current.requests):
        columns = group.attention_mask[row].nonzero().flatten()
        ids = state.all_ids[:-1]  # the last token is pending, not yet in the cache
        assert len(columns) == len(ids)
        reference = KVCache(1, 30)
        fp32.off.runner.forward(ForwardInputs.contiguous(torch.tensor([ids])), reference)
        for layer in (0, 4, 29):
            keys, _ = group.cache.layer(layer)  # type: ignore[misc]
            ref_keys, _ = reference.layer(layer)  # type: ignore[misc]
            torch.testing.assert_close(keys[row][:, columns], ref_keys[0], atol=1e-4, rtol=1e-4)


def test_no_drafting_when_the_cost_model_says_it_cannot_pay(fp32: Pair) -> None:
    """A draft that costs a full step never pays: verified requests decode plainly from the start
    (the cost model decides before any cycle), and their output is unchanged."""
    lm = make_lm(fp32.model_path, fp32.model, "verified", fp32.policy)  # auto_off on (the default)
    lm.costs.model = CostModel.flat(step_s=1.0, verify_s=(1.0,) * (MAX_DRAFT + 1), layer_s=0.0)
    ids = [i for i, (name, _) in enumerate(ALL) if name == "chat"][:2]
    tokens, _, _, reports = run(lm, [make_request(i, fp32.prompts[i], NEW_TOKENS) for i in ids])
    for i in ids:
        stats = reports[i].stats  # type: ignore[attr-defined]
        # n-gram copies cost nothing to draft, and verification here is priced at one step, so
        # they may run; the layer-skipping draft model never does.
        assert stats["model_drafted"] == 0, stats
        assert tokens[i] == fp32.expected[i]


def test_drafting_that_does_not_pay_stops(fp32: Pair, tmp_path: Path) -> None:
    """A policy that promises acceptance 0.99 on a model that delivers ~0.5: drafting starts (the
    prior says it pays); each cycle is planned from the request's own acceptance, so after the
    first rejections the cost model moves it to plain decoding (measured: one cycle of 4 drafts,
    then plain steps); its output is unchanged."""
    policy = write_policy(fp32.model, tmp_path / "optimistic.json", SIX_LAYERS, draft=DraftSettings(0, 0.99))
    lm = make_lm(fp32.model_path, fp32.model, "verified", policy)
    lm.controller.ngram = False  # model drafts only: copied drafts would take most cycles
    # a draft costs 0.5 steps and verification one step: the two rows' group (MIN_GAIN_ROWS, 1.15x)
    # drafts only above acceptance ~0.76
    lm.costs.model = CostModel.flat(step_s=1.0, verify_s=(1.0,) * (MAX_DRAFT + 1), layer_s=0.5 / len(SIX_LAYERS))
    ids = [i for i, (name, _) in enumerate(ALL) if name == "chat"][:2]
    tokens, _, _, reports = run(lm, [make_request(i, fp32.prompts[i], NEW_TOKENS) for i in ids])
    for i in ids:
        stats = reports[i].stats  # type: ignore[attr-defined]
        assert 1 <= stats["cycles"] <= DraftTuning().min_cycles_before_auto_off, stats
        assert stats["model_accepted"] / stats["model_drafted"] < 0.9
        assert tokens[i] == fp32.expected[i]


def test_extreme_sampling_in_verified_mode_is_served_beside_a_neighbour(fp32: Pair) -> None:
    """A temperature that overflows float32 (valid: > 0) drafts and verifies as its greedy limit,
    with off's tokens, while a greedy neighbour in the same cycles keeps its own."""
    prompt = chat_text(fp32.off.tokenizer, "Tell me a story about a dragon.")
    extreme = {"do_sample": True, "seed": 3, "temperature": 1e-37, "top_p": 0.9}
    off, _, _, _ = run(fp32.off, [make_request(1, prompt, 24, **extreme)])  # type: ignore[arg-type]
    tokens, _, _, reports = run(fp32.verified, [make_request(1, prompt, 24, **extreme),  # type: ignore[arg-type]
                                                make_request(2, fp32.prompts[8], NEW_TOKENS)])
    assert tokens[1] == off[1]
    assert tokens[2] == fp32.expected[8]
    assert reports[1].stats["drafted"] > 0  # type: ignore[attr-defined]
