"""Scheduler: the library API for embedding layer skipping next to any causal LM.

    scheduler = Scheduler.from_model(model, policy_path="policy.json", mode="lossy")
    plan = scheduler.plan(input_ids)          # SkipPlan (detector -> decider)
    mask = scheduler.bitmask(input_ids)       # int32 [num_layers], 1 runs, 0 skipped
    report = scheduler.verify_consistency(input_ids, plan)

The server uses the same objects: IdentityMap, AlignedPolicy, detector, RuleTable, SkipPlan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .bypass import bypassed
from .detector import DetectorScores, detect, detect_batch
from .fingerprint import FingerprintConfig
from .identity import DecoderLayers, IdentityMap, find_decoder_layers
from .plan import LayerSkipMode, SkipPlan, check_mode
from .policy import AlignedPolicy, align_policy, read_policy

InputIds = torch.Tensor | Sequence[int] | np.ndarray


def as_ids(input_ids: InputIds) -> torch.Tensor:
    """One prompt's token ids as a 1-D int64 tensor (accepts [seq] or [1, seq])."""
    ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be one prompt's integer ids, shape [seq] or [1, seq]; "
                         f"got {ids.dtype} {tuple(ids.shape)} (use plan_batch for batches)")
    return ids.long()


@dataclass(frozen=True)
class ConsistencyReport:
    """The full forward against the skipping forward on one prompt.

    Attributes:
        skipped: the layers bypassed in the skipping forward.
        logits_max_abs_diff: max |full - skip| over the prompt's last-position logits.
        kl_divergence: KL(full || skip) of the last-position next-token distributions, nats.
        full_tokens / skip_tokens: greedy continuations (no cache, recomputed every step).
        matching_prefix: how many leading greedy tokens agree.
    """

    skipped: tuple[int, ...]
    logits_max_abs_diff: float
    kl_divergence: float
    full_tokens: tuple[int, ...]
    skip_tokens: tuple[int, ...]
    matching_prefix: int

    @property
    def tokens_equal(self) -> bool:
        return self.full_tokens == self.skip_tokens


class _EmbeddingsOnly(nn.Module):
    """What a detached Scheduler keeps of its model (Scheduler.detach_model)."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    def get_input_embeddings(self) -> nn.Module:
        return self.embedding


class Scheduler:
    """Plans per prompt for one loaded model under one aligned policy."""

    def __init__(self, model: nn.Module, layers: DecoderLayers, identity: IdentityMap,
                 policy: AlignedPolicy, mode: str) -> None:
        self.model: nn.Module = model
        self.layers: DecoderLayers | None = layers
        self.identity = identity
        self.policy = policy
        self.mode = check_mode(mode)
        self._returns_tuple: bool | None = None

    @classmethod
    def from_model(cls, model: nn.Module, policy_path: str | Path | None = None, mode: str = LayerSkipMode.LOSSY,
                   *, fingerprint: FingerprintConfig | None = None) -> Scheduler:
        """Find the decoder layers, fingerprint them, and align the policy (if any).

        Args:
            model: a loaded transformers causal LM (any dtype, bitsandbytes int8/nf4/fp4).
            policy_path: a policy JSON file; without one nothing is ever skipped.
            mode: default mode of the plans ("off", "shadow", "lossy", "verified").
            fingerprint: fingerprint settings when there is no policy (a policy brings its own).

        Raises:
            ValueError: the policy is refused (the message names why); skipping stays off.
        """
        check_mode(mode)
        policy = read_policy(policy_path) if policy_path is not None else None
        config = policy.identity.fingerprint if policy is not None else fingerprint
        identity = IdentityMap.from_model(model, config)
        layers = find_decoder_layers(model)
        if policy is None:
            return cls(model, layers, identity, AlignedPolicy.no_skipping(identity.num_layers), mode)
        try:
            aligned = align_policy(policy, identity, Path(str(policy_path)).parent, str(policy_path))
            _check_biases(aligned, model)
        except ValueError as err:
            raise ValueError(f"policy file {policy_path} is refused: {err}") from err
        return cls(model, layers, identity, aligned, mode)

    @property
    def num_layers(self) -> int:
        return self.identity.num_layers

    def detach_model(self, embedding: nn.Module | None = None) -> None:
        """Keep only the model's input embeddings (what the detector reads; `embedding`: a module
        computing the same lookups), for a server whose own runner executes the layers: the
        decoder layers' weights are then not held here, and a runner that re-laid them out
        (bitsandbytes codes in its kernels' format) does not keep them twice.
        `verify_consistency` needs the model and refuses afterwards."""
        self.model = _EmbeddingsOnly(embedding or self.model.get_input_embeddings())  # type: ignore[operator]
        self.layers = None

    def embed(self, input_ids: InputIds) -> torch.Tensor:
        """[seq, hidden] input embeddings of one prompt (the model's own embedding module)."""
        ids = as_ids(input_ids)
        embedding = self.model.get_input_embeddings()  # type: ignore[operator]
        with torch.no_grad():
            device = next((p.device for p in embedding.parameters()), torch.device("cpu"))
            embeddings: torch.Tensor = embedding(ids.unsqueeze(0).to(device))[0]
        return embeddings  # [seq, hidden]

    def scores(self, input_ids: InputIds) -> DetectorScores:
        return detect(self.embed(input_ids), self.policy.detector)

    def plan_embeddings(self, embeddings: torch.Tensor, mode: str | None = None) -> SkipPlan:
        """Plan from [seq, hidden] valid-token embeddings (the server embeds once, itself)."""
        return self.policy.decide(detect(embeddings, self.policy.detector), mode or self.mode)

    def plan(self, input_ids: InputIds, mode: str | None = None) -> SkipPlan:
        """Detector -> decider for one prompt; `mode` overrides the scheduler's default."""
        return self.policy.decide(self.scores(input_ids), mode or self.mode)

    def plan_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   mode: str | None = None) -> list[SkipPlan]:
        """One plan per row of a padded batch [batch, seq]; equal to planning each row alone."""
        embedding = self.model.get_input_embeddings()  # type: ignore[operator]
        with torch.no_grad():
            embeddings = embedding(input_ids.long())  # [batch, seq, hidden]
        scores = detect_batch(embeddings, attention_mask, self.policy.detector)
        return [self.policy.decide(s, mode or self.mode) for s in scores]

    def bitmask(self, input_ids: InputIds, mode: str | None = None) -> np.ndarray:
        """int32 [num_layers]: 1 where the layer runs for this prompt, 0 where it is skipped."""
        return self.plan(input_ids, mode).bitmask(self.num_layers)

    def verify_consistency(self, input_ids: InputIds, plan: SkipPlan,
                           max_new_tokens: int = 8) -> ConsistencyReport:
        """Compare the full forward with a forward that bypasses `plan.skipped`.

        The plan's skip set is used whatever its mode (a shadow plan is checked as if it were
        applied). Greedy continuations run without a KV cache, so a bypassed layer's missing
        cache cannot matter.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: use at least 1")
        if self.layers is None:
            raise RuntimeError("verify_consistency needs the model's layers; this scheduler kept only "
                               "its embeddings (detach_model)")
        plan.check_layers(self.num_layers)
        ids = as_ids(input_ids).unsqueeze(0)  # [1, seq]
        full_logits, full_tokens = self._greedy(ids, max_new_tokens)
        biases = self.policy.biases if self.policy.bypass == "graceful" else None
        with bypassed(self.layers.modules, plan.skipped, biases, bool(self._returns_tuple)):
            skip_logits, skip_tokens = self._greedy(ids, max_new_tokens)
        log_p = torch.log_softmax(full_logits, dim=-1)
        log_q = torch.log_softmax(skip_logits, dim=-1)
        kl = float((log_p.exp() * (log_p - log_q)).sum())
        prefix = next((i for i, (a, b) in enumerate(zip(full_tokens, skip_tokens, strict=True)) if a != b),
                      len(full_tokens))
        return ConsistencyReport(tuple(sorted(plan.skipped)), float((full_logits - skip_logits).abs().max()),
                                 kl if math.isfinite(kl) else math.inf, full_tokens, skip_tokens, prefix)

    def _greedy(self, ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        device = self.model.get_input_embeddings().weight.device  # type: ignore[operator]
        ids = ids.to(device)
        tokens: list[int] = []
        first: torch.Tensor | None = None
        hook = None
        if self._returns_tuple is None:
            assert self.layers is not None, "verify_consistency checked it"
            hook = self.layers.modules[0].register_forward_hook(self._record_output_kind)
        try:
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    logits = self.model(input_ids=ids, use_cache=False).logits[0, -1].double()  # [vocab]
                    first = logits if first is None else first
                    token = int(logits.argmax())
                    tokens.append(token)
                    ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        finally:
            if hook is not None:
                hook.remove()
        assert first is not None, "max_new_tokens >= 1 gives at least one forward"
        return first.cpu(), tuple(tokens)

    def _record_output_kind(self, module: nn.Module, args: object, output: object) -> None:
        self._returns_tuple = isinstance(output, tuple)


def _check_biases(policy: AlignedPolicy, model: nn.Module) -> None:
    """The sidecar biases fit the hidden size, and the draft vocabulary fits the model's vocabulary."""
    if policy.draft_vocab is not None:
        policy.draft_vocab.check(int(model.get_input_embeddings().weight.shape[0]))  # type: ignore[operator]
    hidden = int(model.get_input_embeddings().weight.shape[-1])  # type: ignore[operator]
    wrong = sorted(i for i, b in policy.biases.items() if b.shape[0] != hidden)
    if wrong:
        raise ValueError(f"its sidecar biases for layers {wrong} do not have the model's hidden "
                         f"size {hidden}")
