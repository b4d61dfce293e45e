"""`--layer-skip-policy auto`: the shipped policy whose fingerprints match the served model.

The repository's `policies/` folder holds one calibrated policy per model that works offline
(with its evidence files beside it). `auto` reads each policy file there, skips those made for
another architecture or layer count at once, and aligns the rest to the loaded model's identity
map (fingerprints, as any policy is aligned). Of those that align, the one calibrated in the served
dtype (its `calibration.dtype`) is used, else the first: a verified policy's skip set and draft
head follow the cost model of the dtype it was made in (a bfloat16 step reads half a float32 one's
bytes, so its drafts pay differently). When none aligns, the shard says so and serves with layer
skipping off. TGI_POLICY_DIR points elsewhere (an image that copies the policies to another place).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from loguru import logger
from torch import nn

from ..env import process_env
from ..layerskip import IdentityMap, align_policy, read_policy
from .loading import dtype_name

AUTO = "auto"


def policy_dir() -> Path:
    """TGI_POLICY_DIR, else the repository's policies/ (next to server/)."""
    return process_env().policy_dir or Path(__file__).resolve().parents[3] / "policies"


def candidates(folder: Path) -> list[Path]:
    """Policy files under `folder` (evidence and report JSON files excluded)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*.json") if not any(tag in p.name for tag in (".evidence.", "report")))


def find_shipped_policy(model: nn.Module, folder: Path | None = None) -> Path | None:
    """The policy in `folder` (default: policy_dir()) that aligns to `model`, calibrated in its
    dtype where one is, or None."""
    folder = folder or policy_dir()
    served = dtype_name(cast(Any, model).get_input_embeddings().weight.dtype)
    identities: dict[str, IdentityMap] = {}
    fits: list[Path] = []
    for path in candidates(folder):
        try:
            policy = read_policy(path)
        except ValueError as err:
            logger.warning(f"--layer-skip-policy auto: skipping {path}: {err}")
            continue
        tag = policy.identity.fingerprint.tag
        if tag not in identities:
            identities[tag] = IdentityMap.from_model(model, policy.identity.fingerprint)
        identity = identities[tag]
        if (policy.identity.architecture, policy.identity.num_layers) != (identity.architecture, identity.num_layers):
            continue
        try:
            align_policy(policy, identity, path.parent, str(path))
        except ValueError as err:
            logger.debug(f"--layer-skip-policy auto: {path} does not fit: {err}")
            continue
        if policy.calibration is not None and policy.calibration.dtype == served:
            return path
        fits.append(path)
    return fits[0] if fits else None
