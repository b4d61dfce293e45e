"""The fast runner on the other supported families, with tiny random-weight models.

These check the architecture-specific paths (Qwen2's q/k/v bias, Mistral's and Gemma 3's
sliding windows, Gemma 3's sandwich and q/k norms, scaled embeddings, per-layer-type RoPE and
logit soft cap) against transformers' own modules: fp32 logits within 1e-4 on a left-padded
prefill and on decode steps that run past the sliding window. No claim about output quality
rests on them (the real default model backs those, test_fast_runner.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from text_generation_server.models.runner import FastLlamaRunner, TransformersRunner, build_runner

from .batching import Stream, real_positions

TOLERANCE = 1e-4
PROMPTS = [[5, 9, 23, 41, 7, 3, 17], [11, 2, 60], [8, 8, 8, 30, 31]]
SMALL = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _gemma3() -> PretrainedConfig:
    return Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            final_logit_softcapping=30.0)


CONFIGS = {
    "gemma3": _gemma3,
    "qwen2": lambda: Qwen2Config(**SMALL),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=4),
}


def _tiny(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make norms and biases non-trivial, so that a missing one shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tiny_model_matches_transformers(family: str) -> None:
    """Prefill against TransformersRunner; decode against transformers recomputing each row
    from scratch without a cache (TransformersRunner's DynamicCache keeps only the window for
    Gemma 3's sliding layers, so it cannot serve as the decode reference there)."""
    model = _tiny(CONFIGS[family]())
    fast = build_runner(model, "auto")
    assert isinstance(fast, FastLlamaRunner), f"auto should pick the fast runner for {family}"
    stream, fast_logits = Stream.prefill(fast, PROMPTS)
    _, ref_logits = Stream.prefill(TransformersRunner(model), PROMPTS)
    diff = (real_positions(fast_logits, PROMPTS) - real_positions(ref_logits, PROMPTS)).abs().max()
    assert diff <= TOLERANCE, f"{family} prefill logits differ by {diff}"
    sequences = [list(p) for p in PROMPTS]
    next_ids = fast_logits[:, -1].argmax(-1)
    for step in range(8):  # runs past the window of 4
        sequences = [s + [int(t)] for s, t in zip(sequences, next_ids, strict=True)]
        logits = stream.step(next_ids)
        with torch.inference_mode():
            expected = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in sequences])
        diff = (logits - expected).abs().max()
        assert diff <= TOLERANCE, f"{family} decode step {step}: logits differ by {diff}"
        next_ids = logits.argmax(-1)


def test_qwen2_keeps_its_qkv_bias() -> None:
    model = _tiny(CONFIGS["qwen2"]())
    attn = model.model.layers[0].self_attn
    expected = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
    _, qkv, qkv_bias, _, _ = FastLlamaRunner(model).layers[0].pre
    if qkv_bias is None:  # on the CPU kernels the fused Projection holds the bias: x = 0 returns it
        qkv_bias = qkv(torch.zeros((1, qkv.k)))[0]
    torch.testing.assert_close(qkv_bias, expected, msg="the fused q/k/v bias is missing or wrong")


def test_unsupported_architecture() -> None:
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert isinstance(build_runner(model, "auto"), TransformersRunner)
    with pytest.raises(ValueError, match="'gpt2'"):
        build_runner(model, "fast")
