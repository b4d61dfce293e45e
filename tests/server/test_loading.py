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
from text_generation_server.models.runner import FastRunnerConfig, ForwardInputs, TransformersRunner, build_runner


@pytest.mark.parametrize(("quantize", "dtype"), [(None, "float32"), (None, "bfloat16"),
                                                 ("bitsandbytes-nf4", "bfloat16"), ("bitsandbytes", "float32")])
@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
def test_loaded_weights_are_transformers_own(model_path: Path, quantize: str | None, dtype: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if quantize is not None:
        pytest.importorskip("bitsandbytes")
    load = LoadConfig(quantize=quantize, dtype=dtype)
    monkeypatch.setattr(loading, "CAST_BLOCK_BYTES", 1 << 20)  # several blocks per large tensor here too
    reads: list[tuple[torch.dtype, int]] = []
    read_into = loading._File.read_into

    def spy(self: loading._File, out: torch.Tensor, offset: int) -> None:
        reads.append((out.dtype, out.numel() * out.element_size()))
        read_into(self, out, offset)

    monkeypatch.setattr(loading._File, "read_into", spy)
    ours = load_model(model_path, load).state_dict()
    # the float32 checkpoint: read into the loaded tensors as float32, in 1 MiB blocks to be cast
    assert reads and all(source == torch.float32 for source, _ in reads)
    assert dtype == "float32" or max(size for _, size in reads) <= 1 << 20
    kwargs: dict = {"dtype": load.torch_dtype}
    if quantize is not None:
        kwargs.update(quantization_config=loading._bnb_config(load), device_map="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs).state_dict()
    assert ours.keys() == theirs.keys()
    differing = [name for name, tensor in theirs.items()
                 if tensor.dtype != ours[name].dtype or not torch.equal(tensor, ours[name])]
    assert not differing, f"loaded differently from transformers' path: {differing[:5]}"


@pytest.mark.parametrize("quantize", [None, "bitsandbytes-nf4"])
@pytest.mark.parametrize("int8_head", [False, True])
def test_deferred_tables_are_read_from_the_checkpoint(tmp_path: Path, model_path: Path, quantize: str | None,
                                                      int8_head: bool) -> None:
    """An untied model loaded with deferred tables holds placeholders for its input embeddings and
    lm_head. The fast runner then looks ids up in the checkpoint's float32 table, cast: the same
    rows as a loaded bfloat16 table, and reads the head (dense or int8) from the checkpoint: the
    same logits as from the model loaded whole. The transformers runner reads both tables in. A
    tied model (the default one) defers nothing."""
    if quantize is not None:
        pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    # intermediate 128, not 96: bitsandbytes 0.50's own 4-bit product (the transformers runner
    # below) fails on AVX-512 BF16 CPUs for k = 96 with blocksize 64 ("shape '[64, 1]' is invalid")
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    load = LoadConfig(quantize=quantize, dtype="bfloat16")
    whole, deferred = load_model(tmp_path, load), load_model(tmp_path, load, defer_tables=True)
    for table in (deferred.get_input_embeddings().weight, deferred.get_output_embeddings().weight):
        assert table.untyped_storage().nbytes() == 2  # one bfloat16 element, broadcast
    runner_config = FastRunnerConfig(int8_head=int8_head)
    served, loaded = build_runner(deferred, "fast", runner_config), build_runner(whole, "fast", runner_config)
    mapped = served.checkpoint_embeddings()
    assert mapped is not None and mapped.source == torch.float32 and served.memory_parts()["embeddings"] is None
    assert loaded.checkpoint_embeddings() is None
    ids = torch.randint(0, 300, (3, 40))
    assert torch.equal(mapped(ids), whole.get_input_embeddings()(ids))
    with pytest.raises(IndexError, match="token ids 0..300 outside the embedding table of 300"):
        mapped(torch.tensor([0, 300]))
    inputs = ForwardInputs.contiguous(ids[:1, :12])
    assert torch.equal(served.forward(inputs, served.new_cache(1)), loaded.forward(inputs, loaded.new_cache(1)))
    by_modules, reference = TransformersRunner(deferred), TransformersRunner(whole)
    assert torch.equal(deferred.get_output_embeddings().weight, whole.get_output_embeddings().weight)
    assert torch.equal(by_modules.forward(inputs, by_modules.new_cache(1)),
                       reference.forward(inputs, reference.new_cache(1)))
    assert not load_model(model_path, LoadConfig(), defer_tables=True)._deferred_tables


@pytest.mark.parametrize("quantize", ["bitsandbytes-nf4", "bitsandbytes"])
@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
def test_a_released_model_leaves_the_runner_whole(model_path: Path, quantize: str) -> None:
    """With `release_model` the fast runner frees each bitsandbytes layer's codes in the model once
    the kernels hold their own layout of them: the model's projections hold nothing, and the
    runner's logits are those of a runner built beside a model left whole."""
    pytest.importorskip("bitsandbytes")
    load = LoadConfig(quantize=quantize, dtype="bfloat16")
    kept, given = load_model(model_path, load), load_model(model_path, load)
    reference = build_runner(kept, "fast")
    released = build_runner(given, "fast", FastRunnerConfig(release_model=True))
    if released.cpu_kernels == "none":
        pytest.skip("the CPU kernels are not built here: the runner keeps bitsandbytes' own layers")
    assert all(layer.mlp.down_proj.weight.numel() == 0 and layer.self_attn.q_proj.weight.numel() == 0
               for layer in given.model.layers)
    assert kept.model.layers[0].mlp.down_proj.weight.numel() > 0
    inputs = ForwardInputs.contiguous(torch.arange(1, 25).view(1, 24))
    assert torch.equal(released.forward(inputs, released.new_cache(1)),
                       reference.forward(inputs, reference.new_cache(1)))
