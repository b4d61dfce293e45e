"""Layer discovery and alignment on tiny random models of several families and wrappers."""

from __future__ import annotations

import pytest
import torch
from layerskip_factories import PeftStyleWrapper, RenamedBlocks, tiny_model
from torch import nn

from text_generation_server.layerskip import IdentityMap, align, find_decoder_layers

EXPECTED_PATHS = {
    "llama": ("model.layers", "LlamaDecoderLayer"),
    "gpt2": ("transformer.h", "GPT2Block"),
    "opt": ("model.decoder.layers", "OPTDecoderLayer"),
    "gemma3": ("model.layers", "Gemma3DecoderLayer"),
}


@pytest.mark.parametrize("family", sorted(EXPECTED_PATHS))
def test_finds_decoder_layers_of_each_family(family: str) -> None:
    model = tiny_model(family)
    identity = IdentityMap.from_model(model)
    path, class_name = EXPECTED_PATHS[family]
    assert identity.layers_path == path
    assert identity.num_layers == 4
    assert [layer.class_name for layer in identity.layers] == [class_name] * 4
    assert [layer.path for layer in identity.layers] == [f"{path}.{i}" for i in range(4)]
    assert identity.layers[0].shapes and all(len(shape) >= 1 for _, shape in identity.layers[0].shapes)
    assert align(identity, IdentityMap.from_model(model)) == {i: i for i in range(4)}


def test_peft_style_wrapper_and_compiled_module_align_to_the_bare_model() -> None:
    model = tiny_model("llama")
    bare = IdentityMap.from_model(model)
    for wrapped, path in ((PeftStyleWrapper(model), "base_model.model.model.layers"),
                          (torch.compile(model), "_orig_mod.model.layers")):
        identity = IdentityMap.from_model(wrapped)
        assert identity.layers_path == path
        assert [layer.fingerprint for layer in identity.layers] == [layer.fingerprint for layer in bare.layers]
        assert align(bare, identity) == {i: i for i in range(4)}


def test_renamed_attribute_is_found_next_to_a_longer_module_list() -> None:
    model = tiny_model("opt")
    renamed = RenamedBlocks(find_decoder_layers(model).modules)
    identity = IdentityMap.from_model(renamed)
    assert identity.layers_path == "trunk.stack_of_blocks"
    assert align(IdentityMap.from_model(model), identity) == {i: i for i in range(4)}


def test_reordered_layer_list_aligns_to_the_moved_layers() -> None:
    model = tiny_model("gemma3")
    reference = IdentityMap.from_model(model)
    layers = find_decoder_layers(model).modules
    order = [2, 0, 3, 1]  # loaded position p holds reference layer order[p]
    model.model.layers = nn.ModuleList(layers[i] for i in order)
    mapping = align(reference, IdentityMap.from_model(model))
    assert mapping == {ref: order.index(ref) for ref in range(4)}


def test_other_checkpoint_of_the_same_shape_is_refused_naming_each_layer() -> None:
    reference = IdentityMap.from_model(tiny_model("llama", seed=0))
    with pytest.raises(ValueError) as err:
        align(reference, IdentityMap.from_model(tiny_model("llama", seed=1)))
    message = str(err.value)
    for index in range(4):
        assert f"layer {index} (LlamaDecoderLayer at model.layers.{index}): no matching layer" in message
    assert "fingerprint distance" in message


def test_other_family_and_other_depth_are_refused() -> None:
    reference = IdentityMap.from_model(tiny_model("llama"))
    with pytest.raises(ValueError, match="is a GPT2Block"):
        align(reference, IdentityMap.from_model(tiny_model("gpt2")))
    with pytest.raises(ValueError, match="the reference has 4 layers, the loaded model 6"):
        align(reference, IdentityMap.from_model(tiny_model("llama", num_layers=6)))


def test_identity_map_round_trips_through_json() -> None:
    identity = IdentityMap.from_model(tiny_model("gpt2"))
    assert IdentityMap.from_json(identity.to_json()) == identity


def test_a_model_without_a_layer_list_is_refused() -> None:
    with pytest.raises(ValueError, match="has no nn.ModuleList"):
        find_decoder_layers(nn.Sequential(nn.Linear(2, 2)))
