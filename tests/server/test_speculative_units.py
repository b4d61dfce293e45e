"""Verified mode's acceptance rule and cost model on synthetic numbers (no model needed)."""

from __future__ import annotations

import pytest
import torch

from text_generation_server.sampling import NextTokenChooser, SamplingParams
from text_generation_server.speculative.accept import Proposal, accept, draft_token
from text_generation_server.speculative.state import CostModel, SpecState

# Critical value of the chi-square distribution with 5 degrees of freedom at p = 0.001.
CHI2_DF5_P001 = 20.515


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_drafts_change_how_many_tokens_a_forward_decides_never_which() -> None:
    """Over 8000 seeds: with two drafts from a distribution unlike the target's, `accept` emits
    exactly the tokens the plain chooser draws at the same positions with the same seed, they
    follow the target distribution (chi-square), and some drafts are kept, some not."""
    target = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    draft = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.5, -2.0])  # deliberately unlike the target
    prefix = [7, 8]
    trials = 8000
    first = torch.zeros(6)
    second = torch.zeros(6)
    accepted = 0
    for seed in range(trials):
        params = SamplingParams(do_sample=True, seed=seed)
        proposal = Proposal()
        for _ in range(2):  # k = 2 drafts from the same draft distribution
            draft_token(params, draft, prefix + proposal.token_ids, proposal)
        verify = torch.stack([target, target, target])  # [k + 1, vocab]
        tokens, _, kept = accept(params, verify, prefix, proposal)
        chooser = NextTokenChooser(params)
        plain = [chooser(target, torch.tensor(prefix + [0] * j))[0] for j in range(len(tokens))]
        assert tokens == plain, (seed, tokens, plain, proposal.token_ids)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
        accepted += kept
    p = target.softmax(-1)
    stat_first, stat_second = chi_square(first, p), chi_square(second, p)
    print(f"\nchi-square (df=5): first token {stat_first:.2f}, second {stat_second:.2f}; "
          f"accepted {accepted / (2 * trials):.2f} of drafts")
    assert stat_first < CHI2_DF5_P001 and stat_second < CHI2_DF5_P001
    assert 0 < accepted < 2 * trials  # both branches of the rule ran


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_adds_the_full_model_token() -> None:
    params = SamplingParams()
    verify = torch.full((4, 5), -5.0)
    for position, token in enumerate([1, 2, 4, 0]):  # the full model's argmax after each prefix
        verify[position, token] = 5.0
    proposal = Proposal(token_ids=[1, 2, 3])
    tokens, logprobs, kept = accept(params, verify, [7, 8], proposal)
    assert (tokens, kept) == ([1, 2, 4], 2)  # drafts 1, 2 agree; 3 is replaced by the model's 4
    assert all(lp < 0 for lp in logprobs)
    tokens, _, kept = accept(params, verify, [7, 8], Proposal(token_ids=[1, 2, 4]))
    assert (tokens, kept) == ([1, 2, 4, 0], 3)  # all drafts agree: the bonus token follows


def test_cost_model_prefers_long_drafts_only_when_acceptance_is_high() -> None:
    cost = CostModel.flat(step_s=0.030, verify_s=(0.030, 0.033, 0.036, 0.039, 0.042, 0.045, 0.048), layer_s=0.001)
    k_high, speed_high = cost.best_k(0.95, 20)
    k_low, speed_low = cost.best_k(0.2, 20)
    assert k_high > k_low and speed_high > 1.0 > speed_low
    assert cost.draft_s(1, frozenset(range(20)), 0) == pytest.approx(0.010)
    state = SpecState()
    state.model.record(drafted=4, accepted=4)
    state.model.record(drafted=4, accepted=1)
    assert state.acceptance == (5 + 1) / (5 + 1 + 2)


def test_fitted_drafts_replace_noisy_draft_timings_by_a_plane_in_layers_and_head_rows() -> None:
    """Drafts timed as 40 ms - 1.5 ms per layer bypassed + 90 ns per head row, with +-3 ms of
    noise on each (as on a shared machine): the fit lies within 1.5 ms of the plane everywhere and
    orders the configurations as the plane does; too few configurations are left as measured."""
    base = CostModel.flat(step_s=0.050, verify_s=(0.050, 0.052), layer_s=0.0015)
    vocab_size = 151936
    generator = torch.Generator().manual_seed(0)
    truth, measured = {}, {}
    for layers in (4, 6, 8, 10, 12):
        for vocab in (0, 4096, 16384, 32768):
            key = (frozenset(range(1, layers + 1)), vocab)
            truth[key] = 0.040 - 0.0015 * layers + 90e-9 * (vocab or vocab_size)
            one, four = (0.003 * (2 * float(torch.rand((), generator=generator)) - 1) for _ in range(2))
            measured[key] = (truth[key] + one, truth[key] + 0.002 + four)
    noisy = CostModel(base.tokens, base.forward_s, base.layer_s, vocab_size=vocab_size, drafts=measured)
    fitted = noisy.fitted_drafts()
    assert max(abs(fitted.drafts[k][0] - truth[k]) for k in truth) < 0.0015
    assert max(abs(fitted.drafts[k][1] - truth[k] - 0.002) for k in truth) < 0.0015
    assert max(abs(noisy.drafts[k][0] - truth[k]) for k in truth) > 0.002  # the noise was there
    assert sorted(truth, key=truth.__getitem__) == sorted(truth, key=lambda k: fitted.drafts[k][0])
    few = CostModel(base.tokens, base.forward_s, base.layer_s, vocab_size=vocab_size,
                    drafts=dict(list(measured.items())[:3]))
    assert few.fitted_drafts() is few
