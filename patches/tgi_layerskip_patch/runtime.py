"""The wrapper around upstream's `CausalLM.generate_token` and the decoder-layer hooks.

Upstream's step runs unchanged; around it the wrapper plans new requests (at prefill) and
tells the layer hooks which rows of this step's batch bypass which layers. Rows follow
`batch.requests` order, as upstream's tensors do.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from tgi_layerskip import Scheduler, SkipPlan
from torch import nn

from .compat import check_upstream
from .config import PatchConfig

PATCHED = "__tgi_layerskip_patched__"
# Requests the router cancels are filtered out of upstream's batch without a final generation,
# so their plans are never finished; the oldest are forgotten beyond this many (ids only grow).
MAX_TRACKED_REQUESTS = 4096


# Upstream's serve command keeps only loguru records whose module name starts with
# "text_generation_server" (its launcher parses them), so the patch's records carry this name.
LOG_NAME = "text_generation_server.tgi_layerskip_patch"


def _log(message: str) -> None:
    try:
        from loguru import logger
    except ImportError:
        print(message, file=sys.stderr)
        return
    logger.patch(lambda record: record.update(name=LOG_NAME)).info(message)  # type: ignore[call-arg]


class LayerSkip:
    """Plans, per-request counters and the forward hooks for one loaded upstream model."""

    def __init__(self, model: nn.Module, config: PatchConfig) -> None:
        try:
            self.scheduler = Scheduler.from_model(model, config.policy, config.mode)
        except ValueError as err:  # fail closed: a refused policy stops the shard
            raise RuntimeError(f"tgi_layerskip_patch: {err}") from err
        self.config = config
        self.policy = self.scheduler.policy
        self.plans: dict[int, SkipPlan] = {}
        self.num_bypassed: dict[int, int] = {}
        self.num_steps: dict[int, int] = {}
        # Set only while upstream's step runs: layer index -> rows [batch] bool to bypass.
        self._rows: dict[int, torch.Tensor] = {}
        self._bypass_counts: torch.Tensor | None = None  # [batch] bypasses in this step
        self._lock = threading.Lock()
        for index, layer in enumerate(self.scheduler.layers.modules):
            layer.register_forward_hook(functools.partial(self._after_layer, index), with_kwargs=True)
        _log(f"layer-skip patch active: mode={config.mode} policy={config.policy or 'none'} "
             f"layers={self.scheduler.num_layers}")

    def plan_new(self, batch: Any) -> list[SkipPlan] | None:
        """At prefill (no KV cache yet) every request of the batch is new: plan each one.

        Returns the plans in row order (warmup batches repeat request id 0, so a prefill uses
        its own list), or None for a decode step (plans are then looked up by request id).
        """
        if batch.past_key_values is not None:
            return None
        input_ids = batch.input_ids  # [batch, seq], left-padded
        mask = batch.attention_mask[:, : input_ids.shape[1]]  # [batch, seq]
        plans = self.scheduler.plan_batch(input_ids, mask)
        for request, plan in zip(batch.requests, plans, strict=True):
            self.plans.pop(request.id, None)  # a reused id (warmup's 0) counts as newest
            self.plans[request.id] = plan
            self.num_bypassed[request.id] = 0
            self.num_steps[request.id] = 0
            self._report({"event": "plan", "request_id": request.id, **plan.to_json(),
                          "applied_layers": sorted(plan.applied)})
        for request_id in list(self.plans)[: max(0, len(self.plans) - MAX_TRACKED_REQUESTS)]:
            del self.plans[request_id], self.num_bypassed[request_id], self.num_steps[request_id]
        return plans

    @contextmanager
    def applying(self, batch: Any, plans: list[SkipPlan] | None) -> Iterator[None]:
        """Arm the layer hooks with this step's rows; count the bypasses they make."""
        if plans is None:
            plans = [self.plans.get(r.id, SkipPlan.off()) for r in batch.requests]
        rows: dict[int, torch.Tensor] = {}
        for index in sorted(set().union(*(p.applied for p in plans))):
            rows[index] = torch.tensor([index in p.applied for p in plans], dtype=torch.bool)
        with self._lock:
            self._rows = rows
            self._bypass_counts = torch.zeros(len(plans), dtype=torch.long)
            try:
                yield
            finally:
                counts = self._bypass_counts.tolist()
                self._rows, self._bypass_counts = {}, None
        for request, count in zip(batch.requests, counts, strict=True):
            if request.id in self.plans:
                self.num_bypassed[request.id] += int(count)
                self.num_steps[request.id] += 1

    def finish(self, generations: Sequence[Any]) -> None:
        """Report and forget the requests that stopped in this step."""
        for generation in generations:
            if getattr(generation, "generated_text", None) is None:
                continue
            request_id = generation.request_id
            plan = self.plans.pop(request_id, None)
            if plan is None:
                continue
            self._report({"event": "finished", "request_id": request_id, "mode": plan.mode,
                          "skipped_layers": sorted(plan.skipped), "rule": plan.rule,
                          "num_steps": self.num_steps.pop(request_id, 0),
                          "num_layers_bypassed": self.num_bypassed.pop(request_id, 0)})

    def _after_layer(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     output: Any) -> Any:
        rows = self._rows.get(index)
        if rows is None:
            return None
        hidden_in = args[0] if args else kwargs["hidden_states"]  # [batch, seq, hidden]
        hidden_out = output[0] if isinstance(output, tuple) else output  # [batch, seq, hidden]
        bias = self.policy.biases.get(index) if self.policy.bypass == "graceful" else None
        passed = hidden_in if bias is None else hidden_in + bias.to(hidden_in.device, hidden_in.dtype)
        mixed = torch.where(rows.to(hidden_out.device).view(-1, 1, 1), passed, hidden_out)
        assert self._bypass_counts is not None, "layer hooks run only inside applying()"
        self._bypass_counts += rows.long()
        return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

    def _report(self, record: dict[str, Any]) -> None:
        if record["event"] == "plan":
            _log(f"layer-skip plan: request {record['request_id']} mode={record['mode']} "
                 f"rule={record['rule']!r} skipped={record['skipped_layers']}")
        if self.config.report is not None:
            with self.config.report.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")


def _wrap_generate_token(original: Callable[..., Any], config: PatchConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_token(self: Any, batch: Any) -> Any:
        skip: LayerSkip | None = self.__dict__.get("_tgi_layerskip")
        if skip is None:
            skip = self.__dict__["_tgi_layerskip"] = LayerSkip(self.model, config)
        with skip.applying(batch, skip.plan_new(batch)):
            generations, next_batch, timings = original(self, batch)
        skip.finish(generations)
        return generations, next_batch, timings

    setattr(generate_token, PATCHED, True)
    return generate_token


def _refuse_other_models(model_class: type, causal_lm_class: type, mode: str) -> None:
    """Wrap Model.__init__ so a model that is not a CausalLM refuses instead of running unpatched."""
    init = model_class.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not isinstance(self, causal_lm_class):
            raise RuntimeError(
                f"tgi_layerskip_patch: TGI_LAYER_SKIP_MODE={mode} patches only upstream's CausalLM, but "
                f"this model loaded as {type(self).__name__}; set USE_FLASH_ATTENTION=false to take "
                "the CausalLM path, or unset TGI_LAYER_SKIP_MODE")

    setattr(__init__, PATCHED, True)
    model_class.__init__ = __init__  # type: ignore[misc]


def apply(causal_lm: ModuleType) -> None:
    """Check upstream, read the configuration and wrap CausalLM.generate_token (idempotent)."""
    version = check_upstream(causal_lm)
    try:
        config = PatchConfig.from_env()
    except ValueError as err:
        raise RuntimeError(f"tgi_layerskip_patch: {err}") from err
    model_class = causal_lm.CausalLM
    if getattr(model_class.generate_token, PATCHED, False):
        return
    model_class.generate_token = _wrap_generate_token(model_class.generate_token, config)
    base = sys.modules["text_generation_server.models.model"].Model
    if not getattr(base.__init__, PATCHED, False):
        _refuse_other_models(base, model_class, config.mode)
    _log(f"tgi_layerskip_patch applied to text-generation-server {version} (mode {config.mode})")
