"""models/loading.py reads each checkpoint tensor with pread and casts it a block of rows at a
time: the loaded model must be bitwise the one transformers' own (memory-mapped) path loads, in
every dtype and bitsandbytes mode the server serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from text_generation_server.models import loading
from text_generation_server.models.loading import LoadConfig, load_model
from text_generation_server.models.runner import ForwardInputs, build_runner


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


def test_untied_embeddings_are_read_from_the_checkpoint(tmp_path: Path, model_path: Path) -> None:
    """An untied model's input embeddings are read from the checkpoint's float32 table per lookup
    and cast: the same rows as the loaded bfloat16 table, the same logits from the fast runner,
    which then holds no table. A tied model (the default one) keeps its loaded table."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    model = load_model(tmp_path, LoadConfig(dtype="bfloat16"))
    mapped = loading.mapped_embeddings(model, tmp_path)
    assert mapped is not None and mapped.source == torch.float32
    ids = torch.randint(0, 300, (3, 40))
    assert torch.equal(mapped(ids), model.get_input_embeddings()(ids))
    with pytest.raises(IndexError, match="token ids 0..300 outside the embedding table of 300"):
        mapped(torch.tensor([0, 300]))
    inputs = ForwardInputs.contiguous(ids[:1, :12])
    loaded, served = build_runner(model, "fast"), build_runner(model, "fast")
    assert served.map_embeddings(mapped) and served.memory_parts()["embeddings"] is None
    assert torch.equal(served.forward(inputs, served.new_cache(1)), loaded.forward(inputs, loaded.new_cache(1)))
    assert loading.mapped_embeddings(load_model(model_path, LoadConfig()), model_path) is None
