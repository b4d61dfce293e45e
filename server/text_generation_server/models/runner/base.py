"""The runner interface: one forward pass of a decoder-only model over a left-padded batch.

Every runner (the fast Llama/Gemma runner, the transformers fallback) takes the same inputs
and updates the same `KVCache`, so that the batch code never knows which one runs. A runner
is the full model; a lossy plan's bypass (`bypassing`) and a verified-mode draft model
(`draft_model`) are views of it with the same `forward(inputs, cache)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from .kv_cache import KVCache, PoolSet


@dataclass(frozen=True)
class ForwardInputs:
    """The new tokens of one forward over a left-padded batch.

    Attributes:
        input_ids / position_ids: `[rows, new]` int64.
        attention_mask: `[rows, cache.length + new]`; 1 = real token, 0 = padding.
        last_only: logits of the last position only (`[rows, 1, vocab]`), else of every new
            position (`[rows, new, vocab]`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    last_only: bool = True

    @classmethod
    def contiguous(cls, ids: torch.Tensor, start: int = 0, last_only: bool = True) -> ForwardInputs:
        """`ids [rows, new]` at positions start.. after `start` cached tokens, none of them padding."""
        rows, new = ids.shape
        return cls(ids, torch.arange(start, start + new).repeat(rows, 1),
                   torch.ones((rows, start + new), dtype=torch.long), last_only)


@dataclass(frozen=True)
class LayerPath:
    """What a forward runs: the layers it bypasses and the head it ends with.

    Attributes:
        skip: decoder layer indices bypassed (their cache entries stay None).
        biases: graceful bypass: a skipped layer with an entry adds it (`[hidden]`, the layer's
            mean residual update) instead of passing the hidden state through.
        head: n rows of the lm_head computed instead of the whole head (a draft's reduced
            vocabulary, `Runner.head_rows(ids)[:n]`); the logits then have n columns.
        draft: a draft model's forward: a runner that keeps cheaper draft weights (the fast
            runner's int8 copy of a dense model's layers and heads) runs on them.
    """

    skip: frozenset[int] = frozenset()
    biases: Mapping[int, torch.Tensor] | None = None
    head: Any = None
    draft: bool = False


FULL = LayerPath()


SCORED_ROWS = 256  # positions (over all rows) whose logits exist at once while scoring


def score_positions(logits_of: Callable[[int, int], torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """`[rows, new]` float32: at each position the log-probability of `targets` there, from the
    logits of positions `start:stop` (`logits_of(start, stop)`, `[rows, stop - start, vocab]`),
    taken a block of positions at a time so that no `[rows, new, vocab]` tensor is held."""
    rows, new = targets.shape
    step = max(1, SCORED_ROWS // rows)
    blocks = [logits_of(start, min(start + step, new)).log_softmax(-1)
              .gather(2, targets[:, start:start + step, None]).squeeze(2) for start in range(0, new, step)]
    return torch.cat(blocks, dim=1).float()


class Model(Protocol):
    """Anything with a forward: a runner (the full model) or a view of it."""

    def forward(self, inputs: ForwardInputs, cache: KVCache) -> torch.Tensor:
        """Run the new tokens, append their keys/values to `cache` and advance it; float32 logits."""
        ...

    def forward_scored(self, inputs: ForwardInputs, cache: KVCache,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the last position's logits (`[rows, 1, vocab]`), and each position's
        log-probability of `targets [rows, new]` (a prompt's next tokens: its prompt logprobs)."""
        ...


class Runner(ABC):
    """A model forward over a left-padded batch with a paged KV cache."""

    name: str  # reported in Info and logs, e.g. "fast-llama" or "transformers"
    cpu_kernels: str  # the CPU kernel variant in use (Info), e.g. "avx2"; "none" for torch's ops
    num_layers: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def pools(self) -> PoolSet:
        """The KV pools of this model's caches, one per skip set (created on first use)."""
        pools = self.__dict__.get("_pools")
        if pools is None:
            pools = self.__dict__["_pools"] = PoolSet(self.num_layers)
        return pools

    def new_cache(self, num_rows: int, skip: frozenset[int] = frozenset()) -> KVCache:
        """An empty cache for num_rows rows, in the pool of the skip set its forwards bypass."""
        return KVCache(num_rows, self.num_layers, pool=self.pools(skip))

    @abstractmethod
    def run(self, inputs: ForwardInputs, cache: KVCache, path: LayerPath) -> torch.Tensor:
        """`forward` along `path` (the views call it)."""

    def forward(self, inputs: ForwardInputs, cache: KVCache) -> torch.Tensor:
        """The full model's forward (see Model.forward)."""
        return self.run(inputs, cache, FULL)

    def forward_scored(self, inputs: ForwardInputs, cache: KVCache,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run_scored(inputs, cache, FULL, targets)

    def run_scored(self, inputs: ForwardInputs, cache: KVCache, path: LayerPath,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_scored` along `path`. This one holds every position's logits at once; a runner
        that can compute the head from hidden states a block at a time overrides it."""
        logits = self.run(replace(inputs, last_only=False), cache, path)
        return logits[:, -1:], score_positions(lambda start, stop: logits[:, start:stop], targets)

    def bypassing(self, skip: frozenset[int], biases: Mapping[int, torch.Tensor] | None = None) -> Model:
        """The model with `skip` bypassed (a lossy plan); itself when nothing is skipped."""
        return self if not skip else RunnerView(self, LayerPath(skip, biases))

    def memory_parts(self) -> dict[str, Any]:
        """What holds this runner's tensors, by part, for memory accounting (engine/memory.py:
        the first part that reaches a tensor counts it)."""
        return {"weights": self}

    def checkpoint_embeddings(self) -> torch.nn.Module | None:
        """The module this runner looks input ids up with where it reads them from the checkpoint
        (loading.MappedEmbedding, for a model loaded with deferred tables); None where it holds
        or reads the model's own table."""
        return None

    def head_rows(self, ids: torch.Tensor) -> Any:
        """Rows `ids` of the lm_head as a draft's reduced head reads them
        (speculative/draft_head.py): `rows[:n]` is the `head` of the first n ids. None where the
        runner computes whole logits only."""
        return None

    def draft_model(self, skip: frozenset[int], head: torch.Tensor | None = None,
                    biases: Mapping[int, torch.Tensor] | None = None) -> Model:
        """The draft model of a verified-mode cycle: `skip` bypassed, `head` (rows of the lm_head)
        as its head, on the runner's draft weights where it keeps any."""
        return RunnerView(self, LayerPath(skip, biases, head, draft=True))


@dataclass(frozen=True)
class RunnerView:
    """A runner along one path (Runner.bypassing, Runner.draft_model)."""

    runner: Runner
    path: LayerPath

    def forward(self, inputs: ForwardInputs, cache: KVCache) -> torch.Tensor:
        return self.runner.run(inputs, cache, self.path)

    def forward_scored(self, inputs: ForwardInputs, cache: KVCache,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.run_scored(inputs, cache, self.path, targets)
