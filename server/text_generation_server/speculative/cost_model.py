"""The draft/verify cost model of verified mode, measured on the loaded runner.

Design note. Whether drafting pays is arithmetic on three measured costs:
- a full forward of `rows` rows of t new tokens each: a plain step is t = 1, a verification of
  k drafts is t = k + 1. On a memory-bound runner rows x t = 2..8 costs about one step (the
  weights are streamed once); on one whose multi-token products leave the fast path it costs
  several. It is measured at one row along a ladder of t and at 2 and 4 rows for t = 1..7,
  and interpolated, so a faster multi-token path (the CPU kernels' verification) is picked up
  by measuring, not coded. Rows are measured apart because 4 rows x 2 tokens is not 1 row x 8
  (four KV caches, padding, rows x t beyond the kernels' 16 leaving the one-call layer): priced as
  one row of 8 tokens, batch-4 drafting looked cheap and lost to plain decoding;
- a draft forward of a configuration (skipped layers + head size, on the runner's draft weights:
  an int8 copy of a dense model's, FastRunnerConfig.draft_weights) at 1 and at 4 rows, measured
  for every configuration the policy's rules name, and estimated for others from the measured
  per-layer and lm_head costs (a calibration, which measures dozens, fits them to a plane in
  layers bypassed and head rows: `fitted_drafts`);
- attention past the measured context: the forwards above run after a `context`-token prefix
  (64), where attention is a small part of a step; each query reads every cached column, so at
  long contexts (summarisation) a price read at 64 columns alone falls short of what a cycle
  costs. The seconds per activation row (rows x new tokens) per cached column are the
  difference of a 4-row x 4-token forward after LONG_CONTEXT columns and after `context`
  columns, and every price adds them for the group's context (drafts for the layers they keep);
- with a per-draft acceptance a, a cycle of k drafts yields (1 - a^(k+1)) / (1 - a) tokens.
Speed-up of a cycle = tokens x step(rows) / (k x draft(rows) + forward(rows, k + 1)).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..models.runner.base import ForwardInputs, LayerPath, Runner, RunnerView
from ..models.runner.kv_cache import KVCache
from ..sampling import NextTokenChooser, SamplingParams
from .draft_head import DraftHeads

MAX_DRAFT = 6  # the largest k without --speculate; Info.speculate reports the limit in force
TOKEN_LADDER = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 28)  # new tokens per measured forward (one row)
BATCH_ROWS = (2, 4)  # row counts whose forwards are measured too, at BATCH_TOKENS new tokens per row
BATCH_TOKENS: tuple[int, ...] = (1, 2, 3, 4, 5, 7)
DRAFT_ROWS = (1, 4)
# Forwards of up to this many activation rows (rows x new tokens) are timed in every round: the
# 4-row verifications that batch-4 draft lengths are chosen from need medians, not one reading.
REPEATED_ROWS = 16
# Cached columns of the forward that prices attention (the columns are zeros: attention's cost does
# not depend on what they hold, and a prefill of 4 x 1024 tokens would cost seconds at warm-up).
LONG_CONTEXT = 1024

DraftKey = tuple[frozenset[int], int]  # (layers bypassed, head size; 0 = the full head)


def tokens_per_cycle(acceptance: float, k: int) -> float:
    """Expected tokens of a cycle with k drafts at per-draft acceptance a (the bonus included)."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])  # beyond the ladder: the last segment's slope
    return ys[-1] + slope * (x - xs[-1])


def monotone(values: Iterable[float]) -> tuple[float, ...]:
    """The least-squares non-decreasing fit of a sequence (pool adjacent violators): forwards of
    more new tokens never cost less, so a ladder that dips is noise, and one noisy rung priced
    as read can keep every draft from paying."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                          blocks[-1][1] + count]
    return tuple(mean for mean, count in blocks for _ in range(int(count)))


@dataclass(frozen=True)
class CostModel:
    """Seconds of forwards on the loaded runner (see module docstring).

    Attributes:
        tokens / forward_s: a full forward of one row of `tokens[i]` new tokens takes `forward_s[i]`.
        layer_s: what bypassing one layer saves in a one-token draft forward.
        draft_base_s: a one-token draft forward that bypasses nothing (on the runner's draft
            weights, see FastRunnerConfig.draft_weights); 0 = a plain step (drafts read the
            model's weights). Unmeasured drafts are priced from it, layer_s and head_s.
        head_s: the full lm_head's share of a one-token forward.
        vocab_size: rows of the full lm_head.
        drafts: measured draft forwards, (skip, head size) -> seconds at 1 and at 4 rows.
        batched: rows -> (new tokens per row, seconds) of full forwards of several rows; without
            it a forward of r rows of t tokens is priced as one row of r x t tokens.
        context: cached columns before every measured forward.
        attention_s: seconds per activation row (rows x new tokens) per cached column beyond
            `context`, over all layers.
        num_layers: the model's layers (a draft pays attention for the layers it keeps); 0: unknown.
        sample_s: choosing one sampled position's token over the full vocabulary (warpers, the
            position's noise, the race; sampling/chooser.py): a sampled row pays it at each
            draft and each verified position.
    """

    tokens: tuple[int, ...]
    forward_s: tuple[float, ...]
    layer_s: float
    head_s: float = 0.0
    vocab_size: int = 1
    drafts: dict[DraftKey, tuple[float, float]] = field(default_factory=dict)
    batched: dict[int, tuple[tuple[int, ...], tuple[float, ...]]] = field(default_factory=dict)
    draft_base_s: float = 0.0
    context: int = 64
    attention_s: float = 0.0
    num_layers: int = 0
    sample_s: float = 0.0
    # full_s at the measured context per (rows, tokens): a cycle's plan prices dozens of forwards
    # per step, and interpolating them afresh each time costs a visible share of the step.
    _prices: dict[tuple[int, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def flat(step_s: float, verify_s: tuple[float, ...], layer_s: float) -> CostModel:
        """A cost model from batch-1 figures: `verify_s[n - 1]` is a forward of n tokens."""
        return CostModel(tuple(range(1, len(verify_s) + 1)), tuple(verify_s), layer_s, 0.0, 1)

    @property
    def step_s(self) -> float:
        return self.full_s(1)

    @property
    def verify_s(self) -> tuple[float, ...]:
        """Forwards of 1 .. MAX_DRAFT + 1 tokens at batch 1 (for logs and reports)."""
        return tuple(self.full_s(1, n) for n in range(1, MAX_DRAFT + 2))

    def full_s(self, rows: int, tokens: int = 1, context: int = 0) -> float:
        """A full forward of `rows` rows of `tokens` new tokens each after `context` cached columns
        (priced at the measured context when fewer)."""
        seconds = self._prices.get((rows, tokens))
        if seconds is None:
            if not self.batched:
                seconds = _interpolate(self.tokens, self.forward_s, rows * tokens)
            else:
                row_counts = (1, *sorted(self.batched))
                per_rows = tuple(_interpolate(*self._row_ladder(r), tokens) for r in row_counts)
                seconds = _interpolate(row_counts, per_rows, rows)
            seconds = self._prices[(rows, tokens)] = max(seconds, 1e-9)
        return seconds + self.attention(rows * tokens, context)

    def attention(self, activation_rows: int, context: int, layers_kept: float = 1.0) -> float:
        """What attention over the columns past the measured context adds to a forward."""
        return self.attention_s * activation_rows * max(context - self.context, 0) * layers_kept

    def _row_ladder(self, rows: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        return (self.tokens, self.forward_s) if rows == 1 else self.batched[rows]

    def draft_s(self, rows: int, skip: frozenset[int], vocab: int, context: int = 0) -> float:
        """One draft forward of `rows` rows with `skip` bypassed and a head of `vocab` rows, after
        `context` cached columns."""
        kept = 1 - len(skip) / self.num_layers if self.num_layers else 1.0
        return self._draft_s(rows, skip, vocab) + self.attention(rows, context, kept)

    def _draft_s(self, rows: int, skip: frozenset[int], vocab: int) -> float:
        measured = self.drafts.get((skip, vocab))
        if measured is not None:
            one, four = measured
            return max(one + (four - one) * (rows - 1) / 3, 1e-9)
        base = self.draft_base_s or self.step_s
        saved = self.layer_s * len(skip)
        if 0 < vocab < self.vocab_size:
            saved += self.head_s * (1 - vocab / self.vocab_size)
        fraction = max(1 - saved / base, 0.05)
        return self.full_s(rows) * base / self.step_s * fraction

    def fitted_drafts(self) -> CostModel:
        """This model with each measured draft replaced by a plane fitted over all of them (least
        squares, per row count): seconds = a - b x layers bypassed + c x head rows. One draft is
        timed only a few times on a shared machine, so drafts measured alone differ by more than
        their heads do and a calibration would choose by noise. Unchanged when the drafts cannot
        pin the plane (fewer than 4, or a single layer count or head size)."""
        keys = list(self.drafts)
        layers = [len(skip) for skip, _ in keys]
        head_rows = [vocab or self.vocab_size for _, vocab in keys]
        if len(keys) < 4 or len(set(layers)) < 2 or len(set(head_rows)) < 2:
            return self
        design = np.array([[1.0, n, h] for n, h in zip(layers, head_rows, strict=True)])
        fits = []
        for column in (0, 1):
            seconds = np.array([self.drafts[key][column] for key in keys])
            coefficients = np.linalg.lstsq(design, seconds, rcond=None)[0]
            fits.append(np.maximum(design @ coefficients, 1e-9))
        drafts = {key: (float(fits[0][i]), float(fits[1][i])) for i, key in enumerate(keys)}
        return replace(self, drafts=drafts)

    def cycle_s(self, rows: int, num_drafts: int, draft: float, verify_tokens: int, context: int = 0) -> float:
        """A cycle: `num_drafts` draft forwards of `draft` s, then verification of `verify_tokens` per row."""
        return num_drafts * draft + self.full_s(rows, verify_tokens + 1, context)

    def speedup(self, k: int, acceptance: float, num_skipped: int | frozenset[int], vocab: int = 0,
                rows: int = 1, context: int = 0) -> float:
        """Expected tokens/s of k-draft cycles relative to plain decoding (one row's view)."""
        skip = num_skipped if isinstance(num_skipped, frozenset) else frozenset(range(num_skipped))
        if k == 0:
            return 1.0
        cycle = self.cycle_s(rows, k, self.draft_s(rows, skip, vocab, context), k, context)
        return tokens_per_cycle(acceptance, k) * self.full_s(rows, 1, context) / cycle

    def best_k(self, acceptance: float, num_skipped: int | frozenset[int], vocab: int = 0, rows: int = 1,
               max_draft: int = MAX_DRAFT, context: int = 0) -> tuple[int, float]:
        """The draft length in 1..max_draft with the highest expected speed-up, and that speed-up."""
        speeds = {k: self.speedup(k, acceptance, num_skipped, vocab, rows, context) for k in range(1, max_draft + 1)}
        k = max(speeds, key=lambda key: speeds[key])
        return k, speeds[k]

    def best_free_k(self, acceptance: float, rows: int = 1, max_draft: int = MAX_DRAFT,
                    min_gain: float = 1.0, context: int = 0) -> tuple[int, float]:
        """Like best_k for drafts that cost nothing to make (n-gram): 0 when none beats min_gain."""
        step = self.full_s(rows, 1, context)
        speeds = {k: tokens_per_cycle(acceptance, k) * step / self.full_s(rows, k + 1, context)
                  for k in range(1, max_draft + 1)}
        k = max(speeds, key=lambda key: speeds[key])
        return (k, speeds[k]) if speeds[k] > min_gain else (0, 1.0)

    def to_json(self) -> dict[str, object]:
        return {"forward_ms": {str(t): s * 1000 for t, s in zip(self.tokens, self.forward_s, strict=True)},
                "step_ms": self.step_s * 1000, "verify_ms": [s * 1000 for s in self.verify_s],
                "verify_over_step": [s / self.step_s for s in self.verify_s],
                "batched_ms": {str(rows): {str(t): s * 1000 for t, s in zip(*ladder, strict=True)}
                               for rows, ladder in self.batched.items()},
                "layer_ms": self.layer_s * 1000, "head_ms": self.head_s * 1000, "context": self.context,
                "attention_us_per_row_column": self.attention_s * 1e6, "sample_ms": self.sample_s * 1000,
                "draft_base_ms": (self.draft_base_s or self.step_s) * 1000,
                "drafts": [{"skip": sorted(skip), "vocab": vocab, "ms_1_row": one * 1000, "ms_4_rows": four * 1000,
                            "draft_over_step": one / self.step_s}
                           for (skip, vocab), (one, four) in self.drafts.items()]}

    @classmethod
    def measure(cls, runner: Runner, draft_configs: Iterable[DraftKey] = (), heads: DraftHeads | None = None,
                repeats: int = 5, context: int = 64, max_tokens: int = 4 * (MAX_DRAFT + 1)) -> CostModel:
        """Time full forwards along TOKEN_LADDER (and BATCH_TOKENS at BATCH_ROWS) and each draft
        configuration, each against a plain step timed right before it, over `repeats` rounds (a
        slow phase of a shared machine then moves a probe and its step alike; see _Timer). Each
        ladder of forwards is kept as its monotone fit (`monotone`)."""
        timer = _Timer(runner, repeats, context)
        ladder = tuple(t for t in TOKEN_LADDER if t <= max_tokens) or (1, 2)
        forward = [timer.add(1, t) for t in ladder]
        batched = {rows: [timer.add(rows, t) for t in BATCH_TOKENS] for rows in BATCH_ROWS}
        long_shape = (BATCH_ROWS[-1], 4)  # rows, new tokens: a batch-4 verification of 3 drafts
        long = timer.add(*long_shape, context=LONG_CONTEXT) if context < LONG_CONTEXT else None
        # The middle half of the layers, as drafts skip them: int8 draft layers cost what their
        # activations make them cost (LLM.int8()'s outlier columns), so which layers are bypassed
        # matters, not only how many.
        layers = runner.num_layers
        half = frozenset(range(layers // 4, layers // 4 + layers // 2))
        draft_base = timer.add(1, 1, draft=True)
        without_half = timer.add(1, 1, half, draft=True)
        tiny_rows = runner.head_rows(torch.arange(64))
        tiny_head = timer.add(1, 1, head=tiny_rows[:64]) if tiny_rows is not None else None
        drafts: dict[DraftKey, tuple[int, int]] = {}
        for skip, vocab in dict.fromkeys(draft_configs):
            head = heads.get(vocab) if heads is not None else None
            weight = head.weight if head is not None else None
            drafts[(skip, vocab)] = (timer.add(1, 1, skip, weight, True), timer.add(4, 1, skip, weight, True))
        seconds = timer.run()
        step = seconds[forward[0]]  # the reference of the head's difference below, as measured
        layer_s = max(seconds[draft_base] - seconds[without_half], 0.0) / max(len(half), 1)
        head_s = max(step - seconds[tiny_head], 0.0) if tiny_head is not None else 0.0
        vocab_size = runner.vocab_size
        attention_s = 0.0
        if long is not None:
            rows, new = long_shape
            short = seconds[batched[rows][BATCH_TOKENS.index(new)]]
            attention_s = max(seconds[long] - short, 0.0) / (rows * new * (LONG_CONTEXT - context))
        return cls(ladder, monotone(seconds[p] for p in forward), layer_s, head_s, vocab_size,
                   {key: (seconds[one], seconds[four]) for key, (one, four) in drafts.items()},
                   {rows: (BATCH_TOKENS, monotone(seconds[p] for p in probes)) for rows, probes in batched.items()},
                   seconds[draft_base], context, attention_s, layers, _sample_seconds(runner.vocab_size, repeats))


def _sample_seconds(vocab_size: int, repeats: int) -> float:
    """Median time of one sampled token choice (temperature 0.7) over `vocab_size` logits."""
    chooser = NextTokenChooser(SamplingParams(do_sample=True, temperature=0.7))
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(0))
    history = torch.arange(64)
    times = []
    for _ in range(max(repeats, 3)):
        start = time.perf_counter()
        chooser(logits, history)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Timer:
    """Forwards of `new` tokens per row after a `context`-token prefix (or a probe's own), added as
    probes and timed in rounds: each probe once per round (forwards of more than REPEATED_ROWS
    activation rows, beyond the kernels' few-row path, only set the slope and run in the first
    round only), each right after a plain one-token step. A probe's figure is the median over
    rounds of its time over that step's, times the median step: what drafting weighs
    is the ratio, and on a shared machine the step itself drifts within seconds, so medians
    of absolute times can misprice a verification for the life of a serving process."""

    def __init__(self, runner: Runner, repeats: int, context: int) -> None:
        self.runner, self.repeats, self.context = runner, repeats, context
        self.caches: dict[int, KVCache] = {}  # one prefilled context per row count (a prefill is costly)
        self.probes: list[tuple[int, int, frozenset[int], torch.Tensor | None, bool, int]] = []

    def add(self, rows: int, new: int, skip: frozenset[int] = frozenset(), head: Any = None,
            draft: bool = False, context: int = 0) -> int:
        """A probe; `draft`: a draft forward (Runner.forward's draft weights); `context`: cached
        columns before it, when more than the timer's (zeros past the prefilled ones)."""
        self.probes.append((rows, new, skip, head, draft, max(context, self.context)))
        return len(self.probes) - 1

    def run(self) -> list[float]:
        ratios: list[list[float]] = [[] for _ in self.probes]
        steps: list[float] = []
        for round_ in range(self.repeats):
            for probe, (rows, new, skip, head, draft, context) in enumerate(self.probes):
                if round_ == 0 or rows * new <= REPEATED_ROWS:
                    steps.append(self.time(1, 1, frozenset(), None))
                    ratios[probe].append(self.time(rows, new, skip, head, draft, context) / steps[-1])
        self.caches.clear()
        step = statistics.median(steps)
        return [statistics.median(values) * step for values in ratios]

    def _cache(self, rows: int) -> KVCache:
        cache = self.caches.get(rows)
        if cache is None:
            context = self.context
            cache = self.caches[rows] = self.runner.new_cache(rows)
            ids = torch.zeros((rows, context), dtype=torch.long)
            mask = torch.ones((rows, context), dtype=torch.long)
            self.runner.forward(ForwardInputs(ids, torch.arange(context).repeat(rows, 1), mask), cache)
        return cache

    def time(self, rows: int, new: int, skip: frozenset[int], head: Any, draft: bool = False,
             context: int = 0) -> float:
        runner, context = self.runner, max(context, self.context)
        cache = self._cache(rows)
        cache.crop(self.context)
        if context > self.context:  # more columns up to `context`: blocks reserved, holding whatever they held
            cache.reserve(context - self.context)
            cache.advance(context - self.context)
        start = time.perf_counter()
        inputs = ForwardInputs.contiguous(torch.zeros((rows, new), dtype=torch.long), context, last_only=False)
        RunnerView(runner, LayerPath(skip, head=head, draft=draft)).forward(inputs, cache)
        return time.perf_counter() - start


class LazyCosts:
    """A runner's cost model, measured at its first use (a shard's warm-up uses it before traffic),
    with the given draft configurations measured as they will run; `model` may be set instead."""

    def __init__(self, runner: Runner, draft_configs: Iterable[DraftKey], heads: DraftHeads | None,
                 max_tokens: int) -> None:
        self.runner, self.draft_configs, self.heads, self.max_tokens = runner, list(draft_configs), heads, max_tokens
        self.model: CostModel | None = None

    def __call__(self) -> CostModel:
        if self.model is None:
            self.model = CostModel.measure(self.runner, self.draft_configs, self.heads, max_tokens=self.max_tokens)
        return self.model

