"""The patch's configuration, read once from the environment (upstream's launcher has no flags
for it; it passes its own environment on to the shard)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PATCH_MODES = ("shadow", "lossy")


@dataclass(frozen=True)
class PatchConfig:
    """
    Attributes:
        mode: TGI_LAYER_SKIP_MODE. "shadow": plans are decided and reported, nothing is
            bypassed (tokens equal upstream's). "lossy": each request's planned layers are
            bypassed for the whole request.
        policy: TGI_LAYER_SKIP_POLICY, a policy JSON file made for this model (required for
            lossy; without one shadow reports empty plans).
        report: TGI_LAYER_SKIP_REPORT, optional JSON-lines file: one "plan" record per request
            at prefill and one "finished" record with its bypass count.
    """

    mode: str
    policy: Path | None = None
    report: Path | None = None

    def __post_init__(self) -> None:
        if self.mode == "verified":
            raise ValueError("TGI_LAYER_SKIP_MODE=verified is not provided by the patch for upstream's "
                             "CausalLM (its batch has no draft/verify step); use shadow or lossy, or "
                             "our image (--layer-skip-mode verified)")
        if self.mode not in PATCH_MODES:
            raise ValueError(f"TGI_LAYER_SKIP_MODE={self.mode!r} is not known; use off, "
                             f"{', '.join(PATCH_MODES)}")
        if self.mode == "lossy" and self.policy is None:
            raise ValueError("TGI_LAYER_SKIP_MODE=lossy needs TGI_LAYER_SKIP_POLICY, the path of a "
                             "policy file made for this model")
        if self.policy is not None and not self.policy.is_file():
            raise ValueError(f"TGI_LAYER_SKIP_POLICY={self.policy} is not a file")

    @classmethod
    def from_env(cls) -> PatchConfig:
        policy = os.environ.get("TGI_LAYER_SKIP_POLICY") or None
        report = os.environ.get("TGI_LAYER_SKIP_REPORT") or None
        return cls(os.environ.get("TGI_LAYER_SKIP_MODE", "off").strip().lower(),
                   Path(policy) if policy else None, Path(report) if report else None)
