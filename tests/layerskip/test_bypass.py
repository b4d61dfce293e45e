"""bypassed(): strict and graceful pass-through on a live transformers model, always restored."""

from __future__ import annotations

import pytest
import torch
from layerskip_factories import tiny_model
from torch import nn

from text_generation_server.layerskip import bypassed, find_decoder_layers


def _layer_io(model: nn.Module, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layer = find_decoder_layers(model).modules[index]
    seen_in: list[torch.Tensor] = []
    seen_out: list[torch.Tensor] = []
    pre = layer.register_forward_pre_hook(lambda m, args, kwargs: seen_in.append(args[0]), with_kwargs=True)
    post = layer.register_forward_hook(lambda m, args, out: seen_out.append(out))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 9, 2]]), use_cache=False)
    pre.remove()
    post.remove()
    return seen_in, seen_out


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gemma3"])
def test_strict_bypass_returns_the_incoming_hidden_state(family: str) -> None:
    model = tiny_model(family)
    layers = find_decoder_layers(model).modules
    with bypassed(layers, {2}):
        seen_in, seen_out = _layer_io(model, 2)
    assert torch.equal(seen_in[0], seen_out[0])
    _, normal_out = _layer_io(model, 2)
    assert not torch.equal(seen_in[0], normal_out[0])  # restored: the layer runs again
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_graceful_bypass_adds_the_bias() -> None:
    model = tiny_model("llama")
    bias = torch.linspace(-1, 1, 64)
    with bypassed(find_decoder_layers(model).modules, {1}, {1: bias}):
        seen_in, seen_out = _layer_io(model, 1)
    assert torch.allclose(seen_out[0], seen_in[0] + bias)


def test_previous_instance_forward_is_restored_after_an_error() -> None:
    model = tiny_model("llama")
    layers = find_decoder_layers(model).modules
    wrapper_forward = layers[1].forward  # what a wrapper such as accelerate would install
    layers[1].__dict__["forward"] = wrapper_forward
    with pytest.raises(RuntimeError, match="boom"), bypassed(layers, {1, 2}):
        raise RuntimeError("boom")
    assert layers[1].__dict__["forward"] is wrapper_forward
    assert "forward" not in layers[2].__dict__
