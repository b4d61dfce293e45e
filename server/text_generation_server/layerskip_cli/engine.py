"""The model the tools measure: loading, greedy decoding and teacher-forced logits with skipped layers.

Design note. Every measurement compares a forward with some decoder layers bypassed against
the full forward. The shard's fast runner skips layers natively (`skip_layers`, no KV cache
for a skipped layer) and is several times faster than transformers' generate on this CPU, so
the tools use it whenever it supports the model. Otherwise they fall back to the plain
transformers model with the library's reference executor (`layerskip.bypassed`, strict bypass).
Both paths bypass a layer the same way: the hidden state passes through unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from text_generation_server.layerskip import IdentityMap, bypassed, find_decoder_layers
from text_generation_server.models.runner.base import ForwardInputs

Skip = frozenset[int]
NO_SKIP: Skip = frozenset()


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a model id or local checkpoint, quantization and dtype (upstream's flag values)."""

    model_id: str
    quantize: str | None = None
    dtype: str = "float32"

    @property
    def label(self) -> str:
        if self.quantize is None:
            return self.dtype
        label = {"bitsandbytes": "int8", "bitsandbytes-nf4": "nf4", "bitsandbytes-fp4": "fp4"}[self.quantize]
        return label if self.dtype == "float32" else f"{label}-{self.dtype}"  # consistency.CANDIDATES' names


class Engine:
    """One loaded model with the operations the tools need (see module docstring)."""

    def __init__(self, spec: ModelSpec, model: Any, tokenizer: Any, runner: Any | None) -> None:
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner
        self.layers = find_decoder_layers(model).modules
        self.num_layers = len(self.layers)
        eos = {tokenizer.eos_token_id, *_as_list(getattr(model.generation_config, "eos_token_id", None))}
        self.eos_ids = frozenset(int(e) for e in eos if e is not None)
        self._identity: IdentityMap | None = None

    @staticmethod
    def load(spec: ModelSpec) -> Engine:
        """Resolve `spec.model_id` (download-weights), load model and tokenizer, pick the runner."""
        from text_generation_server.download import download_weights
        from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
        from text_generation_server.models.runner import build_runner

        path = download_weights(spec.model_id)
        model = load_model(path, LoadConfig(quantize=spec.quantize, dtype=spec.dtype))
        torch.set_grad_enabled(False)
        runner = build_runner(model, "auto")
        engine = Engine(spec, model, load_tokenizer(path), runner if runner.name.startswith("fast") else None)
        engine.identity  # noqa: B018  (fingerprint before the first forward: bitsandbytes repacks 4-bit weights then)
        return engine

    @property
    def backend(self) -> str:
        return self.runner.name if self.runner is not None else "transformers+bypassed"

    @property
    def identity(self) -> IdentityMap:
        if self._identity is None:
            self._identity = IdentityMap.from_model(self.model)
        return self._identity

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[seq, hidden] input embeddings of one prompt (for the detector)."""
        embedding = self.model.get_input_embeddings()
        with torch.no_grad():
            out: torch.Tensor = embedding(ids[None])[0]
        return out

    @contextmanager
    def _bypass(self, skip: Skip) -> Iterator[None]:
        with bypassed(self.layers, skip) if skip else nullcontext():
            yield

    def logits(self, ids: torch.Tensor, skip: Skip = NO_SKIP) -> torch.Tensor:
        """[seq, vocab] float32 logits of every position of `ids` [seq], no cache."""
        with torch.inference_mode():
            if self.runner is not None:
                out = self.runner.bypassing(skip).forward(ForwardInputs.contiguous(ids[None], last_only=False),
                                                          self.runner.new_cache(1))
                return out[0].float()
            with self._bypass(skip):
                return self.model(input_ids=ids[None], use_cache=False).logits[0].float()

    def greedy(self, ids: torch.Tensor, skip: Skip = NO_SKIP, max_new_tokens: int = 16,
               reference: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Greedy continuation of `ids` [seq]; stops at EOS, or one token after diverging from `reference`."""
        tokens: list[int] = []
        step = self._decoder(ids, skip)
        token = step(None)
        while True:
            tokens.append(token)
            i = len(tokens) - 1
            diverged = reference is not None and (i >= len(reference) or reference[i] != token)
            if diverged or token in self.eos_ids or len(tokens) >= max_new_tokens:
                return tuple(tokens)
            token = step(token)

    def _decoder(self, ids: torch.Tensor, skip: Skip) -> Callable[[int | None], int]:
        """A step function: None runs the prefill, a token runs one decode step; returns the argmax."""
        state: dict[str, Any] = {"length": int(ids.shape[0])}
        if self.runner is not None:
            cache = self.runner.new_cache(1)

            def run(new: torch.Tensor, start: int) -> torch.Tensor:
                model = self.runner.bypassing(skip)  # type: ignore[union-attr]
                return model.forward(ForwardInputs.contiguous(new[None], start), cache)[0, -1]
        else:
            from transformers import DynamicCache
            past = DynamicCache(config=self.model.config)

            def run(new: torch.Tensor, start: int) -> torch.Tensor:
                with self._bypass(skip), torch.inference_mode():
                    out = self.model(input_ids=new[None], past_key_values=past, use_cache=True,
                                     position_ids=torch.arange(start, start + new.shape[0])[None])
                return out.logits[0, -1]

        def step(token: int | None) -> int:
            if token is None:
                logits = run(ids, 0)
            else:
                logits = run(torch.tensor([token]), state["length"])
                state["length"] += 1
            return int(logits.argmax())
        return step

    def decode_step_timer(self, ids: torch.Tensor, skip: Skip) -> Callable[[], float]:
        """After a prefill of `ids`, a function that times one decode step (ms) at the same position."""
        assert self.runner is not None, "latency is measured with the fast runner"
        runner = self.runner
        cache = runner.new_cache(1)
        n = int(ids.shape[0])
        model = runner.bypassing(skip)
        model.forward(ForwardInputs.contiguous(ids[None]), cache)
        step = ForwardInputs.contiguous(ids[-1:][None], n)

        def timed() -> float:
            cache.crop(n)  # overwrite the same cache column every time
            start = time.perf_counter()
            model.forward(step, cache)
            return (time.perf_counter() - start) * 1e3
        return timed

    def layer_io(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input, output) hidden states [seq, hidden] of every decoder layer in one full forward."""
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            hidden_in = args[0] if args else kwargs["hidden_states"]
            hidden_out = output[0] if isinstance(output, tuple) else output
            captured.append((hidden_in[0].detach().float(), hidden_out[0].detach().float()))
        handles = [layer.register_forward_hook(hook, with_kwargs=True) for layer in self.layers]
        try:
            with torch.inference_mode():
                self.model(input_ids=ids[None], use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        assert len(captured) == self.num_layers, f"captured {len(captured)} of {self.num_layers} layers"
        return captured


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def kl_divergence(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per row of [..., vocab] logits, in nats (float64)."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(candidate.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def teacher_forced(engine: Engine, ids: torch.Tensor, continuation: tuple[int, ...],
                   reference_logits: torch.Tensor | None, skip: Skip) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `ids + continuation` under `skip`, restricted to the positions predicting the continuation.

    Returns (candidate, reference) logits [len(continuation), vocab]; the reference is
    recomputed without skipping when not given (it must cover the same positions).
    """
    full = torch.cat([ids, torch.tensor(continuation, dtype=torch.long)])
    start, end = ids.shape[0] - 1, ids.shape[0] - 1 + len(continuation)
    candidate = engine.logits(full, skip)[start:end]
    reference = engine.logits(full)[start:end] if reference_logits is None else reference_logits
    return candidate, reference
