"""models/loading.py reads each checkpoint tensor with pread and casts it a block of rows at a
time: the loaded model must be bitwise the one transformers' own (memory-mapped) path loads, in
every dtype and bitsandbytes mode the server serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from text_generation_server.models import loading
from text_generation_server.models.loading import LoadConfig, load_model


@pytest.mark.parametrize(("quantize", "dtype"), [(None, "float32"), (None, "bfloat16"),
                                                 ("bitsandbytes-nf4", "bfloat16"), ("bitsandbytes", "float32")])
@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
def test_loaded_weights_are_transformers_own(model_path: Path, quantize: str | None, dtype: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if quantize is not None:
        pytest.importorskip("bitsandbytes")
    load = LoadConfig(quantize=quantize, dtype=dtype)
    monkeypatch.setattr(loading, "CAST_BLOCK_BYTES", 1 << 20)  # several blocks per large tensor here too
    ours = load_model(model_path, load).state_dict()
    kwargs: dict = {"dtype": load.torch_dtype}
    if quantize is not None:
        kwargs.update(quantization_config=loading._bnb_config(load), device_map="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs).state_dict()
    assert ours.keys() == theirs.keys()
    differing = [name for name, tensor in theirs.items()
                 if tensor.dtype != ours[name].dtype or not torch.equal(tensor, ours[name])]
    assert not differing, f"loaded differently from transformers' path: {differing[:5]}"
