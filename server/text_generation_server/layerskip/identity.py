"""The identity map: which decoder layers a model has, and what each one is.

Design note. Layer lists live at different paths (`model.layers`, `transformer.h`,
`model.decoder.layers`), behind wrappers (`base_model.model` of PEFT, `_orig_mod` of
torch.compile) and sometimes under renamed attributes, so we do not hard-code paths: the
decoder layer list is the `nn.ModuleList` of identical-class blocks holding the most
(logical) parameters. Each layer is then described by its index, path, unwrapped class name,
logical parameter shapes and a weight fingerprint (fingerprint.py). `align` maps the layers of
a reference (a policy's model) onto a loaded model by class, shapes and fingerprint, never by
position, and fails closed naming every layer it cannot place.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .fingerprint import FingerprintConfig, distance_matrix, layer_fingerprint, logical_shape

# Attribute names under which wrappers keep the module they wrap: torch.compile, activation
# checkpointing, FSDP, DataParallel/DDP, PEFT tuner layers.
WRAPPER_ATTRS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module", "base_layer")
# Parameters that adapters add next to the base weights (PEFT LoRA); not part of the identity.
ADAPTER_MARKERS = ("lora_", "adapter")


def unwrap(module: nn.Module) -> nn.Module:
    """Follow wrapper attributes down to the wrapped module."""
    seen = 0
    while seen < 8:
        inner = next((getattr(module, a) for a in WRAPPER_ATTRS
                      if isinstance(getattr(module, a, None), nn.Module)), None)
        if inner is None:
            return module
        module, seen = inner, seen + 1
    return module


def _relative_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRS)


def identity_params(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(relative name without wrapper segments, parameter) pairs that define a layer."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, param in layer.named_parameters():
        if any(marker in name for marker in ADAPTER_MARKERS):
            continue
        out.append((_relative_name(name), param))
    return out


def _logical_numel(module: nn.Module) -> int:
    return sum(int(np.prod(logical_shape(p))) for p in module.parameters())


@dataclass(frozen=True)
class DecoderLayers:
    """The decoder layer list found in a model (live modules, not a value to store)."""

    path: str
    modules: nn.ModuleList

    def __len__(self) -> int:
        return len(self.modules)


def _layer_lists(model: nn.Module) -> Iterator[tuple[str, nn.ModuleList]]:
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            classes = {type(unwrap(child)).__name__ for child in module}
            if len(classes) == 1:
                yield path, module


def find_decoder_layers(model: nn.Module) -> DecoderLayers:
    """The ModuleList of identical-class blocks that holds the most parameters.

    Raises:
        ValueError: the model has no ModuleList of identical-class blocks.
    """
    best: tuple[int, int, str, nn.ModuleList] | None = None
    for path, layers in _layer_lists(model):
        key = (_logical_numel(layers), len(layers), path, layers)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of identical-class blocks; "
                         "layer skipping needs a decoder layer list")
    return DecoderLayers(path=best[2], modules=best[3])


def architecture_name(model: nn.Module) -> str:
    """`config.architectures[0]` when the model says it, else its unwrapped class name."""
    config = getattr(unwrap(model), "config", None) or getattr(model, "config", None)
    architectures = getattr(config, "architectures", None)
    if architectures:
        return str(architectures[0])
    return type(unwrap(model)).__name__


@dataclass(frozen=True)
class LayerIdentity:
    """What one decoder layer is, independent of its position and storage.

    Attributes:
        index: position in the model's decoder layer list.
        path: module path of the layer in the model it was read from (informative only).
        class_name: the layer's class after unwrapping (e.g. "LlamaDecoderLayer").
        shapes: (relative parameter name, logical shape) pairs, sorted by name.
        fingerprint: `<scheme tag>:<hex bits>` from fingerprint.layer_fingerprint.
    """

    index: int
    path: str
    class_name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "path": self.path, "class": self.class_name,
                "shapes": {name: list(shape) for name, shape in self.shapes},
                "fingerprint": self.fingerprint}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> LayerIdentity:
        shapes = tuple(sorted((str(n), tuple(int(d) for d in s)) for n, s in dict(data["shapes"]).items()))
        return LayerIdentity(index=int(data["index"]), path=str(data["path"]),
                             class_name=str(data["class"]), shapes=shapes,
                             fingerprint=str(data["fingerprint"]))

    def describe(self) -> str:
        return f"layer {self.index} ({self.class_name} at {self.path})"


@dataclass(frozen=True)
class IdentityMap:
    """The identity of every decoder layer of one model.

    Attributes:
        architecture: e.g. "LlamaForCausalLM".
        layers_path: where the decoder layer list was found.
        layers: one LayerIdentity per layer, in list order.
        fingerprint: the settings that computed (and must match) the fingerprints.
    """

    architecture: str
    layers_path: str
    layers: tuple[LayerIdentity, ...]
    fingerprint: FingerprintConfig = field(default_factory=FingerprintConfig)

    def __post_init__(self) -> None:
        for position, layer in enumerate(self.layers):
            assert layer.index == position, f"layer at position {position} says index {layer.index}"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @staticmethod
    def from_model(model: nn.Module, config: FingerprintConfig | None = None) -> IdentityMap:
        """Find the decoder layers of `model` and fingerprint each one."""
        config = config or FingerprintConfig()
        found = find_decoder_layers(model)
        layers = []
        for index, layer in enumerate(found.modules):
            params = identity_params(layer)
            layers.append(LayerIdentity(
                index=index, path=f"{found.path}.{index}", class_name=type(unwrap(layer)).__name__,
                shapes=tuple(sorted((name, logical_shape(p)) for name, p in params)),
                fingerprint=layer_fingerprint(params, config)))
        return IdentityMap(architecture_name(model), found.path, tuple(layers), config)

    def to_json(self) -> dict[str, Any]:
        fp = self.fingerprint
        return {"architecture": self.architecture, "layers_path": self.layers_path,
                "num_layers": self.num_layers,
                "fingerprint": {"bits_per_tensor": fp.bits_per_tensor, "num_chunks": fp.num_chunks,
                                "seed": fp.seed, "max_distance": fp.max_distance},
                "layers": [layer.to_json() for layer in self.layers]}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> IdentityMap:
        layers = tuple(LayerIdentity.from_json(item) for item in data["layers"])
        if int(data["num_layers"]) != len(layers):
            raise ValueError(f"model identity says num_layers={data['num_layers']} "
                             f"but lists {len(layers)} layers")
        return IdentityMap(str(data["architecture"]), str(data["layers_path"]), layers,
                           FingerprintConfig(**dict(data["fingerprint"])))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _why_not(ref: LayerIdentity, loaded: Sequence[LayerIdentity], distances: np.ndarray,
             max_distance: float) -> str:
    nearest = int(np.argmin(distances))
    near = loaded[nearest]
    if near.class_name != ref.class_name:
        return f"nearest loaded layer {near.index} is a {near.class_name}"
    if near.shapes != ref.shapes:
        return f"nearest loaded layer {near.index} has other parameter shapes"
    return (f"nearest loaded layer {near.index} is at fingerprint distance "
            f"{distances[nearest]:.3f} > {max_distance:.3f}")


def align(reference: IdentityMap | Sequence[LayerIdentity], loaded: IdentityMap) -> dict[int, int]:
    """Map each reference layer index to the loaded layer that is the same layer.

    A reference layer matches a loaded layer with the same class name, the same logical
    parameter shapes and a fingerprint within `loaded.fingerprint.max_distance`; the match
    must be unique and no loaded layer may be claimed twice.

    Raises:
        ValueError: naming each reference layer that has no unique match (fails closed).
    """
    ref_layers = tuple(reference.layers if isinstance(reference, IdentityMap) else reference)
    max_distance = loaded.fingerprint.max_distance
    problems = []
    if len(ref_layers) != loaded.num_layers:
        problems.append(f"the reference has {len(ref_layers)} layers, the loaded model "
                        f"{loaded.num_layers}")
    dist = distance_matrix([r.fingerprint for r in ref_layers], [g.fingerprint for g in loaded.layers])
    for i, ref in enumerate(ref_layers):
        for j, got in enumerate(loaded.layers):
            if got.class_name != ref.class_name or got.shapes != ref.shapes:
                dist[i, j] = 1.0
    mapping: dict[int, int] = {}
    claimed: dict[int, int] = {}
    for i, ref in enumerate(ref_layers):
        candidates = np.flatnonzero(dist[i] <= max_distance) if loaded.num_layers else np.array([])
        if len(candidates) == 0:
            reason = _why_not(ref, loaded.layers, dist[i], max_distance) if loaded.num_layers else "empty model"
            problems.append(f"{ref.describe()}: no matching layer ({reason})")
        elif len(candidates) > 1:
            problems.append(f"{ref.describe()}: ambiguous, matches loaded layers {candidates.tolist()}")
        elif int(candidates[0]) in claimed:
            problems.append(f"{ref.describe()}: loaded layer {int(candidates[0])} is already the match "
                            f"of reference layer {claimed[int(candidates[0])]}")
        else:
            claimed[int(candidates[0])] = ref.index
            mapping[ref.index] = int(candidates[0])
    if problems:
        raise ValueError("layer identities do not align with the loaded model "
                         f"({loaded.architecture}):\n  " + "\n  ".join(problems))
    return mapping
