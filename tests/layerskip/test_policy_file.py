"""Policy files: round trip, alignment across quantizations, and every kind of refusal."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from layerskip_factories import tiny_model
from torch import nn

from text_generation_server.layerskip import (
    Calibration,
    Condition,
    IdentityMap,
    Policy,
    Rule,
    RuleTable,
    load_policy,
    save_policy,
)

CALIBRATION = Calibration(dataset="unit-test prompts", dataset_sha256="0" * 64, consistency=0.9,
                          skip_rate=0.1, date="2026-11-29")


def _policy(identity: IdentityMap, skip: frozenset[int] = frozenset({1, 2}), **kwargs: Any) -> Policy:
    n = identity.num_layers
    table = RuleTable((Rule("calm", (Condition("max_score", "<", 10.0),), skip),), Rule("default"), n,
                      allow_protected=bool(kwargs.pop("allow_protected", False)))
    return Policy.from_table(identity, table, **{"calibration": CALIBRATION, **kwargs})


@pytest.fixture()
def tiny() -> tuple[nn.Module, IdentityMap]:
    model = tiny_model("llama", num_layers=4)
    return model, IdentityMap.from_model(model)


def _edit(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_round_trip_keeps_rules_and_evidence(tiny: tuple[nn.Module, IdentityMap], tmp_path: Path) -> None:
    _, identity = tiny
    path = save_policy(_policy(identity), tmp_path / "p.json")
    aligned = load_policy(path, identity)
    assert aligned.table.rules[0].skip == frozenset({1, 2})
    assert aligned.calibration == CALIBRATION and aligned.source == str(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1 and data["model"]["num_layers"] == 4
    assert data["rules"][0]["skip"][0]["fingerprint"] == identity.layers[1].fingerprint


def test_policy_follows_layers_through_a_reordered_list(tiny: tuple[nn.Module, IdentityMap], tmp_path: Path) -> None:
    model, identity = tiny
    path = save_policy(_policy(identity), tmp_path / "p.json")
    layers = model.model.layers
    model.model.layers = nn.ModuleList([layers[0], layers[2], layers[1], layers[3]])
    aligned = load_policy(path, IdentityMap.from_model(model))
    assert aligned.layer_map == {0: 0, 1: 2, 2: 1, 3: 3}
    assert aligned.table.rules[0].skip == frozenset({1, 2})


def test_graceful_biases_round_trip_through_the_sidecar(tiny: tuple[nn.Module, IdentityMap], tmp_path: Path) -> None:
    _, identity = tiny
    biases = {1: torch.full((64,), 0.5), 2: torch.full((64,), -0.5)}
    path = save_policy(_policy(identity, bypass="graceful"), tmp_path / "g.json", biases)
    assert (tmp_path / "g.safetensors").is_file()
    aligned = load_policy(path, identity)
    assert aligned.bypass == "graceful" and torch.equal(aligned.biases[2], biases[2])


REFUSALS: list[tuple[str, Any, str]] = [
    ("unknown schema version", lambda d: d.update(schema_version=99),
     "schema_version 99 is not supported; this build reads schema_version 1"),
    ("no schema version", lambda d: d.pop("schema_version"), "has no schema_version"),
    ("missing rules", lambda d: d.pop("rules"), "a required field is missing: 'rules'"),
    ("out-of-range layer", lambda d: d["rules"][0]["skip"].append({"index": 7, "fingerprint": "x"}),
     "rule 'calm' names layer 7, out of range for the policy's model with 4 layers"),
    ("fingerprint of another layer", lambda d: d["rules"][0]["skip"][0].update(
        fingerprint=d["model"]["layers"][3]["fingerprint"]),
     "rule 'calm' names layer 1 with a fingerprint that is not the policy model's layer 1"),
    ("protected layer", lambda d: d["rules"][0]["skip"].append(
        {"index": 3, "fingerprint": d["model"]["layers"][3]["fingerprint"]}),
     "rule 'calm' skips protected layers \\[3\\]"),
    ("unknown feature", lambda d: d["rules"][0]["when"][0].update(feature="loudness"),
     "condition feature 'loudness' is not known"),
    ("unknown bypass", lambda d: d.update(bypass="gentle"), "bypass 'gentle' is not known"),
    ("graceful without sidecar", lambda d: d.update(bypass="graceful"),
     "graceful bypass needs a sidecar"),
    ("missing sidecar", lambda d: d.update(sidecar="gone.safetensors"), "its sidecar .*gone.safetensors is missing"),
    ("bad calibration", lambda d: d["calibration"].update(consistency=1.5),
     "calibration consistency=1.5: use a fraction in \\[0, 1\\]"),
]


@pytest.mark.parametrize(("what", "change", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_bad_policy_is_refused_with_its_message(tiny: tuple[nn.Module, IdentityMap], tmp_path: Path,
                                                what: str, change: Any, message: str) -> None:
    _, identity = tiny
    path = save_policy(_policy(identity), tmp_path / "p.json")
    _edit(path, change)
    with pytest.raises(ValueError, match=f"policy file {path} is refused: .*{message}"):
        load_policy(path, identity)


def test_corrupt_and_unreadable_files_are_refused(tiny: tuple[nn.Module, IdentityMap], tmp_path: Path) -> None:
    _, identity = tiny
    path = tmp_path / "p.json"
    path.write_text('{"schema_version": 1, "model": ')
    with pytest.raises(ValueError, match="is corrupt: not valid JSON"):
        load_policy(path, identity)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="top level must be a JSON object, got list"):
        load_policy(path, identity)
    with pytest.raises(ValueError, match="cannot be read"):
        load_policy(tmp_path / "absent.json", identity)


def test_policy_for_another_model_is_refused_naming_each_layer(tiny: tuple[nn.Module, IdentityMap],
                                                               tmp_path: Path) -> None:
    _, identity = tiny
    path = save_policy(_policy(identity), tmp_path / "p.json")
    other = IdentityMap.from_model(tiny_model("llama", seed=3, num_layers=4))
    with pytest.raises(ValueError) as err:
        load_policy(path, other)
    message = str(err.value)
    assert "it was made for another model (LlamaForCausalLM)" in message
    for index in range(4):
        assert f"layer {index} (LlamaDecoderLayer at model.layers.{index}): no matching layer" in message


def test_sidecar_without_a_skipped_layer_bias_is_refused(tiny: tuple[nn.Module, IdentityMap], tmp_path: Path) -> None:
    _, identity = tiny
    path = save_policy(_policy(identity, bypass="graceful"), tmp_path / "g.json", {1: torch.zeros(64)})
    with pytest.raises(ValueError, match="has no bias for skipped layers \\[2\\]"):
        load_policy(path, identity)


def test_protected_layers_load_when_the_policy_allows_them(tiny: tuple[nn.Module, IdentityMap],
                                                           tmp_path: Path) -> None:
    _, identity = tiny
    path = save_policy(_policy(identity, skip=frozenset({0, 3}), allow_protected=True), tmp_path / "p.json")
    assert load_policy(path, identity).table.rules[0].skip == frozenset({0, 3})


def test_float32_policy_applies_to_the_same_layers_of_nf4_and_int8(
        real_identities: dict[str, IdentityMap], tmp_path: Path) -> None:
    reference = real_identities["float32"]
    skip = frozenset({4, 9, 17, 23})
    path = save_policy(_policy(reference, skip=skip), tmp_path / "smollm2.json")
    max_distance = reference.fingerprint.max_distance
    from text_generation_server.layerskip import distance

    for name in ("nf4", "int8"):
        loaded = real_identities[name]
        applied = load_policy(path, loaded).table.rules[0].skip
        named = json.loads(path.read_text())["rules"][0]["skip"]
        # Each layer the policy names by fingerprint is the loaded layer it resolved to.
        for ref, index in zip(named, sorted(applied), strict=True):
            assert distance(ref["fingerprint"], loaded.layers[index].fingerprint) <= max_distance
        assert applied == skip, name
        # The same nf4/int8 layers listed in reverse order: the policy follows the weights.
        reversed_layers = tuple(replace(layer, index=i) for i, layer in enumerate(reversed(loaded.layers)))
        shuffled = IdentityMap(loaded.architecture, loaded.layers_path, reversed_layers, loaded.fingerprint)
        last = loaded.num_layers - 1
        assert load_policy(path, shuffled).table.rules[0].skip == frozenset(last - i for i in skip), name


def test_auto_prefers_the_policy_calibrated_in_the_served_dtype(tmp_path: Path) -> None:
    from text_generation_server.models.shipped_policies import find_shipped_policy

    model = tiny_model("llama", num_layers=4)
    identity = IdentityMap.from_model(model)
    other = IdentityMap.from_model(tiny_model("llama", seed=1, num_layers=4))
    save_policy(_policy(other, calibration=replace(CALIBRATION, dtype="float32")), tmp_path / "a-other.json")
    bf16 = save_policy(_policy(identity, calibration=replace(CALIBRATION, dtype="bfloat16")), tmp_path / "b.json")
    fp32 = save_policy(_policy(identity, calibration=replace(CALIBRATION, dtype="float32")), tmp_path / "c.json")
    assert json.loads(fp32.read_text())["calibration"]["dtype"] == "float32"
    assert load_policy(bf16, identity).calibration == replace(CALIBRATION, dtype="bfloat16")
    assert find_shipped_policy(model, tmp_path) == fp32  # another model's float32 policy is passed over
    assert find_shipped_policy(model.to(torch.bfloat16), tmp_path) == bf16
    fp32.unlink()
    assert find_shipped_policy(model.float(), tmp_path) == bf16  # none for float32: the one that aligns
    bf16.unlink()
    assert find_shipped_policy(model, tmp_path) is None
    # A policy without a recorded dtype (made before dtypes were recorded) still loads, without the key.
    old = save_policy(_policy(identity), tmp_path / "d.json")
    assert "dtype" not in json.loads(old.read_text())["calibration"] and find_shipped_policy(model, tmp_path) == old
