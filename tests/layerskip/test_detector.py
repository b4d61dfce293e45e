"""Detector: deterministic per prompt, padding excluded, sane on short prompts."""

from __future__ import annotations

import pytest
import torch

from text_generation_server.layerskip import DetectorConfig, detect, detect_batch


def _embeddings(seed: int, seq: int, hidden: int = 32) -> torch.Tensor:
    return torch.randn(seq, hidden, generator=torch.Generator().manual_seed(seed))


def _pad(rows: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(r.shape[0] for r in rows)
    batch = torch.full((len(rows), seq, rows[0].shape[1]), 7.0)  # padding is garbage, not zeros
    mask = torch.zeros(len(rows), seq, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(seq - row.shape[0], seq) if left else slice(0, row.shape[0])
        batch[i, span], mask[i, span] = row, 1
    return batch, mask


@pytest.mark.parametrize("left", [False, True])
def test_same_prompt_gives_identical_scores_in_any_batch(left: bool) -> None:
    config = DetectorConfig()
    prompt = _embeddings(0, 11)
    alone = detect(prompt, config)
    for others in ([_embeddings(1, 3)], [_embeddings(2, 40), _embeddings(3, 1)]):
        batch, mask = _pad([*others, prompt], left)
        assert detect_batch(batch, mask, config)[-1] == alone  # exact, not approximate


def test_dtype_of_the_embeddings_only_matters_through_their_values() -> None:
    prompt = _embeddings(4, 16).to(torch.bfloat16)
    assert detect(prompt, DetectorConfig()) == detect(prompt.float(), DetectorConfig())


def test_repetitive_prompt_scores_lower_than_a_varied_one() -> None:
    varied = _embeddings(5, 32)
    repeated = _embeddings(6, 1).repeat(32, 1)
    config = DetectorConfig()
    calm, busy = detect(repeated, config), detect(varied, config)
    assert calm.max_score < busy.max_score and calm.mean_score < busy.mean_score
    assert calm.max_score < 1e-12 and 0.0 < busy.spectral_entropy <= 1.0


@pytest.mark.parametrize("seq", [0, 1, 2, 3])
def test_short_prompts_give_finite_scores(seq: int) -> None:
    scores = detect(_embeddings(7, seq), DetectorConfig())
    assert scores.num_tokens == seq
    assert all(v == v and abs(v) < 1e9 for v in scores.as_dict().values())


def test_long_prompts_are_scored_on_their_last_max_tokens() -> None:
    prompt = _embeddings(8, 50)
    short = detect(prompt, DetectorConfig(max_tokens=20))
    assert short.num_tokens == 50
    assert short.max_score == detect(prompt[-20:], DetectorConfig()).max_score


def test_config_and_shapes_are_validated() -> None:
    with pytest.raises(ValueError, match="window=1"):
        DetectorConfig(window=1)
    with pytest.raises(ValueError, match="gradient_weight=1.5"):
        DetectorConfig(gradient_weight=1.5)
    with pytest.raises(ValueError, match="\\[seq, hidden\\]"):
        detect(torch.zeros(1, 2, 3), DetectorConfig())
    with pytest.raises(ValueError, match="disagree"):
        detect_batch(torch.zeros(2, 3, 4), torch.ones(2, 4), DetectorConfig())
