"""Units of token choice's warpers and seeded sampler (sampling/chooser.py), no model needed."""

from __future__ import annotations

import math

import pytest
import torch

from text_generation_server.sampling import NextTokenChooser, SamplingParams, apply_warpers
from text_generation_server.sampling.chooser import LEAD_NATS


def finite(logits: torch.Tensor, kept: torch.Tensor) -> set[int]:
    return {i for i in kept.nonzero().flatten().tolist() if math.isfinite(float(logits[i]))}


def nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> set[int]:
    """Upstream's top-p rule (transformers' TopPLogitsWarper) in float64: sort ascending and
    remove words while their cumulative probability is at most 1 - top_p, keeping the last; then
    the words tied with the least likely word kept, whatever their place in the sort."""
    ascending, order = torch.sort(logits.double())
    remove = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    remove[-1] = False
    kept = ~remove.scatter(0, order, remove)
    return finite(logits, logits >= logits[kept].min())


def typical_by_full_sort(logits: torch.Tensor, typical_p: float) -> set[int]:
    """Upstream's typical-p rule (transformers' TypicalLogitsWarper) in float64: sort by the
    distance of surprisal from entropy, cut where the cumulative probability reaches typical_p,
    keep every word at most as far as the word there."""
    logp = logits.double().log_softmax(-1)
    distance = (-logp + (logp.exp() * logp).nansum()).abs()
    ordered, order = torch.sort(distance)
    last = int((logp.exp()[order].cumsum(-1) < typical_p).sum())
    return finite(logits, distance <= ordered[min(last, len(ordered) - 1)])


WARPERS = {"top_p": nucleus_by_full_sort, "typical_p": typical_by_full_sort}


@pytest.mark.parametrize("warper", list(WARPERS))
@pytest.mark.parametrize("vocab", [7, 1000, 151936])
def test_top_p_and_typical_p_keep_upstream_s_words(warper: str, vocab: int) -> None:
    """Peaked and flat distributions, some in bf16 values (ties), some with half the words masked,
    kept sets from 1 word to most of a 152k vocabulary, and words needed 18 nats below the best
    (beyond the LEAD_NATS that are ordered first): the words kept are those of a sort of the whole
    vocabulary, exactly, and keep their logits."""
    generator = torch.Generator().manual_seed(vocab)
    largest = 0
    for case in range(15):
        logits = torch.randn(vocab, generator=generator) * (0.1, 1.0, 3.0, 10.0, 0.1)[case % 5]
        if case % 2:  # bf16 values: many ties, some at the cut
            logits = logits.bfloat16().float()
        if case % 3 == 0:
            logits[torch.randperm(vocab, generator=generator)[: vocab // 2]] = -math.inf
        if case % 5 == 4:  # one word 18 nats above the rest, whose mass is needed at 0.999999
            logits[0] = 18.0
        for p in (0.1, 0.5, 0.9, 0.95, 0.999, 0.999999):
            warped = apply_warpers(logits, SamplingParams(**{warper: p}))  # type: ignore[arg-type]
            kept = torch.isfinite(warped)
            assert finite(logits, kept) == WARPERS[warper](logits, p), (case, p)
            assert torch.equal(warped[kept], logits[kept])
            largest = max(largest, int(kept.sum()))
            if case % 5 == 4 and p == 0.999999 and vocab > 7:  # noqa: PLR2004
                assert bool((logits[kept] < 18.0 - LEAD_NATS).any()), "the ordered words were widened"
    assert largest >= vocab // 2  # kept sets reach most of the vocabulary


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
