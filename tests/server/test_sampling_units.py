"""Units of token choice's warpers and seeded sampler (sampling/chooser.py), no model needed."""

from __future__ import annotations

import math

import pytest
import torch

from text_generation_server.sampling import NextTokenChooser, SamplingParams, apply_warpers
from text_generation_server.sampling.chooser import TOP_P_CANDIDATES


def nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> set[int]:
    """Upstream's top-p rule (transformers' TopPLogitsWarper) in float64: sort ascending and
    remove words while their cumulative probability is at most 1 - top_p, keeping the last."""
    ascending, order = torch.sort(logits.double())
    remove = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    remove[-1] = False
    kept = (~remove.scatter(0, order, remove)).nonzero().flatten().tolist()
    return {i for i in kept if math.isfinite(float(logits[i]))}


@pytest.mark.parametrize("vocab", [7, 1000, 151936])
def test_top_p_keeps_upstream_s_nucleus(vocab: int) -> None:
    """Peaked and flat distributions, some with half the words masked, nuclei from 1 word to
    most of a 152k vocabulary (far beyond the TOP_P_CANDIDATES that topk looks at first): the
    words kept are the full sort's, exactly, and keep their logits."""
    generator = torch.Generator().manual_seed(vocab)
    largest = 0
    for case in range(12):
        logits = torch.randn(vocab, generator=generator) * (0.1, 1.0, 3.0, 10.0)[case % 4]
        if case % 3 == 0:
            logits[torch.randperm(vocab, generator=generator)[: vocab // 2]] = -math.inf
        for top_p in (0.1, 0.5, 0.9, 0.95, 0.999):
            warped = apply_warpers(logits, SamplingParams(top_p=top_p))
            kept = torch.isfinite(warped)
            assert set(kept.nonzero().flatten().tolist()) == nucleus_by_full_sort(logits, top_p), (case, top_p)
            assert torch.equal(warped[kept], logits[kept])
            largest = max(largest, int(kept.sum()))
    if vocab > TOP_P_CANDIDATES:
        assert largest > TOP_P_CANDIDATES  # the path that takes more candidates ran


def test_a_seeded_choice_depends_on_its_seed_and_position_only() -> None:
    """The sampler's token at a position is the same whichever positions were chosen before it
    (and by which chooser); another seed or position draws another token somewhere."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))
    history = torch.arange(40)
    params = SamplingParams(do_sample=True, temperature=0.8, seed=7)
    in_order = [NextTokenChooser(params)(logits, history[:n])[0] for n in range(10, 40)]
    fresh = NextTokenChooser(params)
    backwards = [fresh(logits, history[:n])[0] for n in reversed(range(10, 40))]
    assert in_order == backwards[::-1]
    other_seed = NextTokenChooser(SamplingParams(do_sample=True, temperature=0.8, seed=8))
    assert in_order != [other_seed(logits, history[:n])[0] for n in range(10, 40)]
    assert len(set(in_order)) > 1  # positions draw different noise
