"""Fingerprint properties on the real default model in float32, bfloat16, int8, nf4 and fp4.

The measured distances that justify FingerprintConfig.max_distance are printed (pytest -s).
"""

from __future__ import annotations

import json
from pathlib import Path

import bitsandbytes.functional as bnbf
import numpy as np
import pytest
import torch
from layerskip_factories import QUANTIZATIONS, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.layerskip import FingerprintConfig, IdentityMap, align
from text_generation_server.layerskip.fingerprint import _4bit_values, distance_matrix, sample_positions
from text_generation_server.models.loading import LoadConfig, load_model

MAX_DISTANCE = FingerprintConfig().max_distance


def _fingerprints(identity: IdentityMap) -> list[str]:
    return [layer.fingerprint for layer in identity.layers]


def test_same_layer_matches_in_every_quantization(real_identities: dict[str, IdentityMap]) -> None:
    reference = real_identities["float32"]
    num_layers = reference.num_layers
    off_diagonal = ~np.eye(num_layers, dtype=bool)
    rows = {}
    for name, identity in real_identities.items():
        dist = distance_matrix(_fingerprints(reference), _fingerprints(identity))
        within, between = np.diag(dist), dist[off_diagonal]
        rows[name] = {"within_max": float(within.max()), "within_mean": float(within.mean()),
                      "between_min": float(between.min()), "between_mean": float(between.mean())}
        assert within.max() <= MAX_DISTANCE, f"{name}: a layer drifted {within.max():.3f} from float32"
        assert align(reference, identity) == {i: i for i in range(num_layers)}
    print(f"\n[layerskip] fingerprint distances to float32 (normalized Hamming, threshold {MAX_DISTANCE}):")
    for name, row in rows.items():
        print(f"  {name:9s} same layer max {row['within_max']:.4f} mean {row['within_mean']:.4f} | "
              f"other layers min {row['between_min']:.4f} mean {row['between_mean']:.4f}")
    print("  " + json.dumps(rows))


def test_two_different_layers_never_match(real_identities: dict[str, IdentityMap]) -> None:
    names = list(real_identities)
    worst = 1.0
    for a in names:
        for b in names:
            dist = distance_matrix(_fingerprints(real_identities[a]), _fingerprints(real_identities[b]))
            np.fill_diagonal(dist, 1.0)
            worst = min(worst, float(dist.min()))
    print(f"\n[layerskip] closest pair of different layers over all quantization pairs: {worst:.4f}")
    assert worst > 2 * MAX_DISTANCE, f"different layers only {worst:.3f} apart (threshold {MAX_DISTANCE})"


def test_logical_shapes_are_recovered_from_int8_and_packed_4bit(real_identities: dict[str, IdentityMap]) -> None:
    reference = real_identities["float32"].layers[3].shapes
    assert dict(reference)["mlp.gate_proj.weight"] == (1536, 576)
    for name in ("int8", "nf4", "fp4"):
        assert real_identities[name].layers[3].shapes == reference, name


def test_reinitialised_checkpoint_of_the_same_architecture_does_not_match(
        real_identities: dict[str, IdentityMap]) -> None:
    config = AutoConfig.from_pretrained(str(download_weights(DEFAULT_MODEL_ID)))
    torch.manual_seed(1234)
    other = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # give the norms real values too, so no tensor is constant
        for name, param in other.named_parameters():
            if "norm" in name:
                param.add_(0.05 * torch.randn_like(param))
    other_identity = IdentityMap.from_model(other)
    dist = distance_matrix(_fingerprints(real_identities["float32"]), _fingerprints(other_identity))
    print(f"\n[layerskip] re-initialised SmolLM2-shaped model: min distance to the real layers {dist.min():.4f}")
    assert dist.min() > 2 * MAX_DISTANCE
    with pytest.raises(ValueError, match="layer 29 \\(LlamaDecoderLayer at model.layers.29\\): no matching layer"):
        align(real_identities["float32"], other_identity)


def test_perturbed_checkpoint_beyond_quantization_noise_does_not_match(
        real_models: dict[str, torch.nn.Module], real_identities: dict[str, IdentityMap]) -> None:
    # A checkpoint whose every weight moved by as much as the weights themselves (a different
    # model of the same shape, not a quantized copy) must not be taken for the original.
    layer = real_models["float32"].model.layers[5]
    params = [(name, p.detach().clone()) for name, p in layer.named_parameters()]
    torch.manual_seed(7)
    moved = [(name, p + torch.randn_like(p) * p.std()) for name, p in params]
    from text_generation_server.layerskip.fingerprint import distance, layer_fingerprint
    d = distance(layer_fingerprint(moved, FingerprintConfig()), real_identities["float32"].layers[5].fingerprint)
    print(f"\n[layerskip] layer 5 plus noise of its own std: distance {d:.4f}")
    assert d > MAX_DISTANCE


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
def test_sampled_4bit_decode_equals_bitsandbytes_dequantize(quant_type: str, nested: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(192, 576)
    packed, state = bnbf.quantize_4bit(weight, quant_type=quant_type, compress_statistics=nested)
    param = torch.nn.Parameter(packed, requires_grad=False)
    param.quant_state = state  # type: ignore[attr-defined]
    positions = sample_positions((192, 576), 16, 3)
    expected = bnbf.dequantize_4bit(packed, state).reshape(-1).index_select(0, torch.from_numpy(positions))
    np.testing.assert_allclose(_4bit_values(param, positions), expected.double().numpy(), rtol=1e-6, atol=1e-6)


def test_second_architecture_matches_across_quantizations(tmp_path: Path) -> None:
    # Gemma 3 270M is not installed on this machine; a tiny random Gemma 3 saved as a
    # checkpoint goes through the same bitsandbytes loading path as the default model.
    model = tiny_model("gemma3", num_layers=6)
    model.save_pretrained(str(tmp_path))
    reference = IdentityMap.from_model(model)
    for name in ("bfloat16", "int8", "nf4", "fp4"):
        loaded = load_model(tmp_path, QUANTIZATIONS[name])
        identity = IdentityMap.from_model(loaded)
        assert identity.layers[0].class_name == "Gemma3DecoderLayer"
        assert align(reference, identity) == {i: i for i in range(6)}, name


def test_fingerprint_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="max_distance=0.6"):
        FingerprintConfig(max_distance=0.6)
    with pytest.raises(ValueError, match="bits_per_tensor=12"):
        FingerprintConfig(bits_per_tensor=12)


def test_load_config_float32_is_the_reference() -> None:
    assert QUANTIZATIONS["float32"] == LoadConfig()
