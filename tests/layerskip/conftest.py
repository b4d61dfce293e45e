"""Session fixtures: identity maps of the default model in every quantization (loaded once)."""

from __future__ import annotations

import gc
import time

import pytest
from layerskip_factories import QUANTIZATIONS, real_model
from transformers import PreTrainedModel

from text_generation_server.layerskip import IdentityMap

_KEPT = ("float32", "nf4")  # models the scheduler and policy tests run; the others are freed


@pytest.fixture(scope="session")
def real_models() -> dict[str, PreTrainedModel]:
    """The default model in float32 and nf4 (plain transformers + bitsandbytes)."""
    return {name: real_model(name) for name in _KEPT}


@pytest.fixture(scope="session")
def real_identities(real_models: dict[str, PreTrainedModel]) -> dict[str, IdentityMap]:
    """IdentityMap of the default model per quantization; prints what each one cost."""
    out = {}
    for name in QUANTIZATIONS:
        model = real_models[name] if name in real_models else real_model(name)
        start = time.perf_counter()
        out[name] = IdentityMap.from_model(model)
        print(f"\n[layerskip] identity map {name}: {time.perf_counter() - start:.3f} s "
              f"for {out[name].num_layers} layers (no timing is asserted)")
        if name not in real_models:
            del model
            gc.collect()
    return out
