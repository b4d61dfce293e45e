"""Watermark: the green list, the logit boost, and the detector's z-test."""

from __future__ import annotations

import pytest
import torch

from text_generation_server.watermark import WatermarkConfig, apply_watermark, detect, green_list

VOCAB = 49152


def test_green_list_is_a_fixed_gamma_share_seeded_by_the_previous_token() -> None:
    first = green_list(17, VOCAB, 0.5)
    assert first.shape == (VOCAB // 2,) and first.unique().numel() == VOCAB // 2
    assert torch.equal(first, green_list(17, VOCAB, 0.5))
    assert not torch.equal(first, green_list(18, VOCAB, 0.5))
    assert green_list(17, VOCAB, 0.25).shape == (VOCAB // 4,)


def test_apply_adds_delta_to_green_tokens_only() -> None:
    logits = torch.zeros(VOCAB)
    apply_watermark(logits, 5, WatermarkConfig(gamma=0.25, delta=3.0))
    green = set(green_list(5, VOCAB, 0.25).tolist())
    boosted = set((logits == 3.0).nonzero().flatten().tolist())
    assert boosted == green and int((logits == 0.0).sum()) == VOCAB - len(green)


def test_detector_separates_green_text_from_chance() -> None:
    generator = torch.Generator().manual_seed(0)
    green_text, plain_text = [11], [11]
    for _ in range(200):
        greens = green_list(green_text[-1], VOCAB, 0.5)
        green_text.append(int(greens[torch.randint(len(greens), (1,), generator=generator)]))
        plain_text.append(int(torch.randint(VOCAB, (1,), generator=generator)))
    marked, plain = detect(green_text, VOCAB), detect(plain_text, VOCAB)
    assert marked.num_green == 200 and marked.is_watermarked()
    assert abs(plain.z_score) < 4.0 and not plain.is_watermarked()


@pytest.mark.parametrize(("gamma", "delta", "message"), [
    (0.0, 2.0, "--watermark-gamma 0.0 must be in"), (1.0, 2.0, "--watermark-gamma 1.0"),
    (0.5, 0.0, "--watermark-delta 0.0 must be positive"),
])
def test_bad_strength_is_refused_naming_the_flag(gamma: float, delta: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WatermarkConfig(gamma=gamma, delta=delta)


def test_detection_needs_two_tokens() -> None:
    with pytest.raises(ValueError, match="at least 2 tokens, got 1"):
        detect([3], VOCAB)
