"""Policy files: a versioned JSON rule table that names layers by fingerprint.

A policy is made (calibrated) on one copy of a model and applied to any copy of the same
checkpoint, quantized or not: on load its model identity is aligned to the loaded model's
identity map, and every rule's layers are translated to the loaded model's indices. Anything
that does not fit is refused with a ValueError that names it; a policy is never half-applied.

File layout (schema_version 1):
    {"schema_version": 1,
     "model": <IdentityMap.to_json(): architecture, num_layers, fingerprint settings, layers>,
     "detector": {"window": 4, "gradient_weight": 0.5, "max_tokens": 2048},
     "allow_protected": false, "bypass": "strict" | "graceful", "sidecar": null | "x.safetensors",
     "rules": [{"name": "calm", "when": [{"feature": "max_score", "op": "<", "value": 0.9}],
                "skip": [{"index": 12, "fingerprint": "simhash1-...:..."}],
                "draft": {"vocab": 16384, "acceptance": 0.82}}],      (draft: optional, verified)
     "default": {"name": "default", "skip": []},
     "calibration": {"dataset": ..., "dataset_sha256": ..., "consistency": 0.93,
                     "skip_rate": 0.2, "date": "2026-11-29", "dtype": "float32"} | null,
                                                                     (dtype: optional)
     "objective": "lossy" | "verified",                               (optional, default lossy)
     "draft_vocab": {"source": ..., "token_ids": [ranked ids]} | null}  (optional, see draft.py)
The optional safetensors sidecar holds graceful-bypass biases: tensor "layer.<index>" is the
mean residual update [hidden] of the policy model's layer <index>.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .decider import Condition, Rule, RuleTable
from .detector import DetectorConfig, DetectorScores
from .draft import DraftSettings, DraftVocab
from .identity import IdentityMap, align
from .plan import LayerSkipMode, SkipPlan

SCHEMA_VERSION = 1
BYPASS_KINDS = ("strict", "graceful")
OBJECTIVES = (LayerSkipMode.LOSSY, LayerSkipMode.VERIFIED)


@dataclass(frozen=True)
class LayerRef:
    """A layer as a policy names it: its index in the policy's model and its fingerprint."""

    index: int
    fingerprint: str


@dataclass(frozen=True)
class PolicyRule:
    """A rule as stored: conditions, the layers (by fingerprint) it skips, its draft settings."""

    name: str
    conditions: tuple[Condition, ...] = ()
    skip: tuple[LayerRef, ...] = ()
    draft: DraftSettings = DraftSettings()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.conditions:
            out["when"] = [c.to_json() for c in self.conditions]
        out["skip"] = [{"index": r.index, "fingerprint": r.fingerprint} for r in self.skip]
        if not self.draft.is_default:
            out["draft"] = self.draft.to_json()
        return out


@dataclass(frozen=True)
class Calibration:
    """The evidence behind a policy.

    Attributes:
        dataset: what the policy was calibrated on (name or path).
        dataset_sha256: hash of that data set's exact content.
        consistency: fraction of calibration prompts whose output matched `off` (0..1).
        skip_rate: mean fraction of layers skipped on that data set (0..1).
        date: ISO date of the calibration run.
        dtype: the compute dtype it was calibrated in ("float32", "bfloat16", ...; None when not
            recorded): a verified policy's choice follows that dtype's cost model, and
            `--layer-skip-policy auto` prefers a policy made for the served dtype.
    """

    dataset: str
    dataset_sha256: str
    consistency: float
    skip_rate: float
    date: str
    dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("consistency", "skip_rate"):
            value = getattr(self, name)
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"calibration {name}={value}: use a fraction in [0, 1]")
        try:
            datetime.date.fromisoformat(self.date[:10])
        except ValueError as err:
            raise ValueError(f"calibration date {self.date!r} is not an ISO date (YYYY-MM-DD)") from err


@dataclass(frozen=True)
class Policy:
    """The content of a policy file (layers named by fingerprint)."""

    identity: IdentityMap
    rules: tuple[PolicyRule, ...]
    default: PolicyRule = PolicyRule("default")
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    allow_protected: bool = False
    bypass: str = "strict"
    calibration: Calibration | None = None
    sidecar: str | None = None
    schema_version: int = SCHEMA_VERSION
    objective: str = LayerSkipMode.LOSSY
    draft_vocab: DraftVocab | None = None

    def __post_init__(self) -> None:
        if self.bypass not in BYPASS_KINDS:
            raise ValueError(f"bypass {self.bypass!r} is not known; use one of {', '.join(BYPASS_KINDS)}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not known; use one of {', '.join(OBJECTIVES)}")
        ranked = len(self.draft_vocab.token_ids) if self.draft_vocab is not None else 0
        for rule in (*self.rules, self.default):
            if rule.draft.vocab > ranked:
                raise ValueError(f"rule {rule.name!r} drafts over {rule.draft.vocab} token ids, but the policy's "
                                 f"draft_vocab ranks {ranked}")
        if self.default.conditions:
            raise ValueError(f"default rule {self.default.name!r} has conditions; a default has none")
        for rule in (*self.rules, self.default):
            for ref in rule.skip:
                self._check_ref(rule.name, ref)

    def _check_ref(self, rule: str, ref: LayerRef) -> None:
        if not 0 <= ref.index < self.identity.num_layers:
            raise ValueError(f"rule {rule!r} names layer {ref.index}, out of range for the policy's "
                             f"model with {self.identity.num_layers} layers")
        if self.identity.layers[ref.index].fingerprint != ref.fingerprint:
            raise ValueError(f"rule {rule!r} names layer {ref.index} with a fingerprint that is not "
                             f"the policy model's layer {ref.index}")

    @staticmethod
    def from_table(identity: IdentityMap, table: RuleTable, **kwargs: Any) -> Policy:
        """A policy from an index-based rule table made on the model `identity` describes."""
        def refs(skip: frozenset[int]) -> tuple[LayerRef, ...]:
            return tuple(LayerRef(i, identity.layers[i].fingerprint) for i in sorted(skip))
        rules = tuple(PolicyRule(r.name, r.conditions, refs(r.skip), r.draft) for r in table.rules)
        default = PolicyRule(table.default.name, (), refs(table.default.skip), table.default.draft)
        return Policy(identity, rules, default, allow_protected=table.allow_protected, **kwargs)

    def to_json(self) -> dict[str, Any]:
        calibration = None if self.calibration is None else {k: v for k, v in vars(self.calibration).items()
                                                             if v is not None}
        return {"schema_version": self.schema_version, "model": self.identity.to_json(),
                "detector": self.detector.to_json(), "allow_protected": self.allow_protected,
                "bypass": self.bypass, "sidecar": self.sidecar,
                "rules": [r.to_json() for r in self.rules], "default": self.default.to_json(),
                "calibration": calibration, "objective": self.objective,
                "draft_vocab": None if self.draft_vocab is None else self.draft_vocab.to_json()}


@dataclass(frozen=True)
class AlignedPolicy:
    """A policy translated to the loaded model: what the scheduler and the executor use.

    Attributes:
        table: the rule table with the loaded model's layer indices.
        detector: the detector settings the policy was calibrated with.
        layer_map: policy layer index -> loaded layer index.
        bypass: "strict" (pass the hidden state through) or "graceful" (add `biases`).
        biases: loaded layer index -> mean residual update [hidden] (graceful only).
        source: where the policy came from (file path or "none").
    """

    table: RuleTable
    detector: DetectorConfig
    layer_map: Mapping[int, int]
    bypass: str = "strict"
    biases: Mapping[int, torch.Tensor] = field(default_factory=dict)
    source: str = "none"
    calibration: Calibration | None = None
    draft_vocab: DraftVocab | None = None
    objective: str = LayerSkipMode.LOSSY

    @staticmethod
    def no_skipping(num_layers: int, detector: DetectorConfig | None = None) -> AlignedPolicy:
        """The built-in policy without a file: plans are computed and nothing is skipped."""
        return AlignedPolicy(RuleTable.empty(num_layers), detector or DetectorConfig(),
                             {i: i for i in range(num_layers)})

    def decide(self, scores: DetectorScores, mode: str) -> SkipPlan:
        return self.table.decide(scores, mode)


def _parse_rule(item: Any) -> PolicyRule:
    if not isinstance(item, Mapping):
        raise ValueError(f"a rule must be a JSON object, got {type(item).__name__}")
    conditions = tuple(Condition.from_json(c) for c in item.get("when", []))
    skip = tuple(LayerRef(int(r["index"]), str(r["fingerprint"])) for r in item.get("skip", []))
    draft = DraftSettings.from_json(item["draft"]) if "draft" in item else DraftSettings()
    return PolicyRule(str(item["name"]), conditions, skip, draft)


def policy_from_json(data: Any) -> Policy:
    """A Policy from the parsed JSON of a policy file; ValueError names what is wrong."""
    if not isinstance(data, Mapping):
        raise ValueError(f"the top level must be a JSON object, got {type(data).__name__}")
    if "schema_version" not in data:
        raise ValueError("it has no schema_version")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"schema_version {data['schema_version']!r} is not supported; "
                         f"this build reads schema_version {SCHEMA_VERSION}")
    try:
        calibration = data.get("calibration")
        return Policy(
            identity=IdentityMap.from_json(data["model"]),
            rules=tuple(_parse_rule(item) for item in data["rules"]),
            default=_parse_rule(data.get("default", {"name": "default"})),
            detector=DetectorConfig(**dict(data.get("detector", {}))),
            allow_protected=bool(data.get("allow_protected", False)),
            bypass=str(data.get("bypass", "strict")), sidecar=data.get("sidecar"),
            calibration=None if calibration is None else Calibration(**dict(calibration)),
            objective=str(data.get("objective", LayerSkipMode.LOSSY)),
            draft_vocab=None if data.get("draft_vocab") is None else DraftVocab.from_json(data["draft_vocab"]))
    except KeyError as err:
        raise ValueError(f"a required field is missing: {err}") from err
    except TypeError as err:
        raise ValueError(f"a field has the wrong type or name: {err}") from err


def read_policy(path: str | Path) -> Policy:
    """Read and validate a policy file (not yet aligned to any model)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"policy file {path} cannot be read: {err.strerror}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"policy file {path} is corrupt: not valid JSON ({err})") from err
    try:
        return policy_from_json(data)
    except ValueError as err:
        raise ValueError(f"policy file {path} is refused: {err}") from err


def _load_biases(policy: Policy, directory: Path, layer_map: Mapping[int, int]) -> dict[int, torch.Tensor]:
    if policy.sidecar is None:
        if policy.bypass == "graceful":
            raise ValueError("graceful bypass needs a sidecar with per-layer biases, and none is named")
        return {}
    sidecar = directory / policy.sidecar
    if not sidecar.is_file():
        raise ValueError(f"its sidecar {sidecar} is missing")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(sidecar))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"its sidecar {sidecar} is corrupt: {err}") from err
    needed = sorted({r.index for rule in (*policy.rules, policy.default) for r in rule.skip})
    missing = [i for i in needed if f"layer.{i}" not in tensors] if policy.bypass == "graceful" else []
    if missing:
        raise ValueError(f"its sidecar {sidecar} has no bias for skipped layers {missing}")
    bad = sorted(k for k, t in tensors.items() if t.dim() != 1)
    if bad:
        raise ValueError(f"its sidecar {sidecar} holds non-vector biases {bad}; each is [hidden]")
    unknown = sorted(k for k in tensors if k.removeprefix("layer.") not in {str(i) for i in layer_map})
    if unknown:
        raise ValueError(f"its sidecar {sidecar} holds tensors {unknown[:5]} that name no layer "
                         "of the policy's model")
    return {layer_map[int(k.removeprefix("layer."))]: t for k, t in tensors.items()}


def align_policy(policy: Policy, identity: IdentityMap, directory: Path, source: str) -> AlignedPolicy:
    """Translate `policy` to the model `identity` describes; ValueError names each problem."""
    if policy.identity.fingerprint.tag != identity.fingerprint.tag:
        raise ValueError(f"its fingerprints use settings {policy.identity.fingerprint.tag}, the "
                         f"loaded model's {identity.fingerprint.tag}; compute the identity map "
                         "with the policy's FingerprintConfig")
    try:
        layer_map = align(policy.identity, identity)
    except ValueError as err:
        raise ValueError(f"it was made for another model ({policy.identity.architecture}): {err}") from err

    def to_rule(rule: PolicyRule) -> Rule:
        return Rule(rule.name, rule.conditions, frozenset(layer_map[r.index] for r in rule.skip), rule.draft)

    table = RuleTable(tuple(to_rule(r) for r in policy.rules), to_rule(policy.default),
                      identity.num_layers, policy.allow_protected)
    return AlignedPolicy(table, policy.detector, layer_map, policy.bypass,
                         _load_biases(policy, directory, layer_map), source, policy.calibration,
                         policy.draft_vocab, policy.objective)


def load_policy(path: str | Path, identity: IdentityMap) -> AlignedPolicy:
    """Read a policy file and align it to the loaded model.

    Args:
        path: the policy JSON file (its sidecar, if any, lies next to it).
        identity: the loaded model's identity map (IdentityMap.from_model).

    Raises:
        ValueError: corrupt file, unknown schema version, wrong model (naming each layer that
            does not align), out-of-range or protected layer, missing sidecar.
    """
    policy = read_policy(path)
    try:
        return align_policy(policy, identity, Path(path).parent, str(path))
    except ValueError as err:
        raise ValueError(f"policy file {path} is refused: {err}") from err


def save_policy(policy: Policy, path: str | Path,
                biases: Mapping[int, torch.Tensor] | None = None) -> Path:
    """Write `policy` as JSON (and `biases`, by policy layer index, to a sidecar next to it)."""
    path = Path(path)
    if biases:
        from safetensors.torch import save_file

        sidecar = path.with_suffix(".safetensors")
        save_file({f"layer.{i}": t.detach().float().contiguous().cpu() for i, t in biases.items()},
                  str(sidecar))
        policy = replace(policy, sidecar=sidecar.name)
    elif policy.bypass == "graceful" and policy.sidecar is None:
        raise ValueError("a graceful-bypass policy needs biases (per-layer mean residual updates)")
    path.write_text(json.dumps(policy.to_json(), indent=1) + "\n", encoding="utf-8")
    return path


def rule_names(policy: Policy | AlignedPolicy) -> Sequence[str]:
    """Rule names in order, default last (for metrics labels)."""
    if isinstance(policy, Policy):
        return [r.name for r in policy.rules] + [policy.default.name]
    return [r.name for r in policy.table.rules] + [policy.table.default.name]
