"""Bypassing decoder layers of a plain transformers model, temporarily.

Design note. This is the library's reference executor for models it does not own (the
server's runner has its own). While the context is active, each skipped layer's `forward` is
replaced on the instance by a pass-through that returns the incoming hidden state (strict) or
the hidden state plus the layer's mean residual update (graceful), so the layer's attention
and MLP never run. In transformers 5 a decoder layer returns the hidden-state tensor itself;
older versions return a tuple whose first item is the hidden state, which `returns_tuple`
reproduces. The previous `forward` (class method, or an instance attribute that a wrapper such
as accelerate installed) is restored on exit, also after an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_MISSING = object()


def _passthrough(bias: torch.Tensor | None, returns_tuple: bool) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]  # [batch, seq, hidden]
        if bias is not None:
            hidden = hidden + bias.to(device=hidden.device, dtype=hidden.dtype)
        return (hidden,) if returns_tuple else hidden
    return forward


@contextmanager
def bypassed(layers: nn.ModuleList, skipped: Iterable[int],
             biases: Mapping[int, torch.Tensor] | None = None,
             returns_tuple: bool = False) -> Iterator[None]:
    """Bypass the layers at `skipped` indices of `layers` inside the `with` block.

    Args:
        layers: the model's decoder layer list (identity.find_decoder_layers(model).modules).
        skipped: indices to bypass.
        biases: index -> [hidden] mean residual update for graceful bypass (strict if absent).
        returns_tuple: whether the layers return a tuple (transformers 4.x) or a tensor.
    """
    saved: list[tuple[nn.Module, object]] = []
    try:
        for index in sorted(set(skipped)):
            layer = layers[index]
            saved.append((layer, layer.__dict__.get("forward", _MISSING)))
            bias = None if biases is None else biases.get(index)
            layer.__dict__["forward"] = _passthrough(bias, returns_tuple)
        yield
    finally:
        for layer, previous in reversed(saved):
            if previous is _MISSING:
                del layer.__dict__["forward"]
            else:
                layer.__dict__["forward"] = previous
