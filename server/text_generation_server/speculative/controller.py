"""Draft control: per cycle, which drafter each row uses and how many drafts; after it, what was learnt.

Design note. Three levels decide, all from the measured cost model and measured acceptance:
- per cycle and group (`plan_cycle`): each speculating row first tries an n-gram match (free
  drafts, length chosen by its copy acceptance); a row whose match is not drafted (its batch
  makes the verification cost more than the copies would save) watches it instead, so that its
  copy acceptance is measured without a verification (ngram.Watch); rows without copies use
  the draft model, and the group's model-draft length k (0 = none) is the one that maximises
  the group's expected tokens per second, plain decoding included as k = 0. So a batch where
  drafting does not pay (costly verification of rows x (k + 1) tokens) simply decodes plainly;
- per rule, across requests (`RuleRecord`): acceptance pooled over every request of a rule,
  starting from the policy's calibrated acceptance as a prior worth rule_prior_weight drafts.
  When a rule's expected speed at batch 1 falls below plain decoding after min_rule_cycles
  cycles, its model drafting is disabled for new requests (logged once); one new request in
  probe_every still drafts, so the rule is re-enabled when its acceptance recovers;
- per request (the floor, "auto-off"): a request whose own acceptance (with its rule's as the
  prior) makes its drafting slower than plain decoding after min_cycles_before_auto_off cycles
  stops model drafting; its n-gram drafts go on when they pay. Until its own drafts weigh as much
  as its prior (request_prior_weight), a request drafts even when the prior puts its group's cycle
  just short of paying (within learn_floor; groups only up to the row counts the cost model
  measured): a prior near the line would otherwise decide for good, from one warm-up reading or
  from another class's drafts under the same rule, without the request's own evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loguru import logger

from .cost_model import MAX_DRAFT, CostModel, tokens_per_cycle
from .ngram import Watch
from .state import Counts, DraftingRow, SpecState
from .tuning import DraftTuning

MAX_SPECULATE = 16  # --speculate limit (a verification of 17 tokens per row)


@dataclass(frozen=True)
class SpeculateConfig:
    """Speculation settings of a shard.

    Attributes:
        speculate: upstream's `--speculate N`: n-gram drafts of up to N tokens per step for every
            request (off and shadow too), and N the longest draft of verified mode as well.
            None (not given): n-gram drafts only in verified mode, drafts up to MAX_DRAFT.
        tuning: the draft controller's knobs.
    """

    speculate: int | None = None
    tuning: DraftTuning = field(default_factory=DraftTuning)

    def __post_init__(self) -> None:
        if self.speculate is not None and not 1 <= self.speculate <= MAX_SPECULATE:
            raise ValueError(f"--speculate {self.speculate}: use 1..{MAX_SPECULATE} draft tokens per step")

    @property
    def max_draft(self) -> int:
        return self.speculate or MAX_DRAFT

    @property
    def ngram_for_all(self) -> bool:
        return self.speculate is not None


def copy_acceptance(spec: SpecState, prior: float) -> float:
    """A request's per-draft acceptance of its copies, drafted and watched, over `prior`."""
    return spec.ngram.plus(spec.watched).estimate(prior)


@dataclass
class RuleRecord:
    """One rule's pooled model-draft statistics."""

    prior: float
    tuning: DraftTuning
    counts: Counts = field(default_factory=Counts)
    disabled: bool = False
    admitted_while_disabled: int = 0

    def estimate(self, excluding: Counts | None = None) -> float:
        """Pooled acceptance, optionally without one request's own counts (its prior)."""
        counts = self.counts if excluding is None else self.counts.without(excluding)
        return counts.estimate(self.prior, self.tuning.rule_prior_weight)

    def record(self, drafted: int, accepted: int) -> None:
        self.counts.record(drafted, accepted)
        if self.counts.cycles > self.tuning.decay_at:
            c = self.counts
            self.counts = Counts(c.cycles // 2, c.drafted // 2, c.accepted // 2, c.rejections // 2)


@dataclass(frozen=True, eq=False)
class RowPlan:
    """One row's part of a cycle: its copied drafts, or whether it takes the model's drafts."""

    state: DraftingRow
    copies: list[int] = field(default_factory=list)  # empty = none
    model: bool = False

    @property
    def spec(self) -> SpecState:
        """The row's speculation state (rows that draft have one)."""
        assert self.state.spec is not None, "a drafting row speculates"
        return self.state.spec

    @property
    def sampled(self) -> bool:
        return self.state.chooser.params.sampling

    def without_copies(self) -> RowPlan:
        return RowPlan(self.state, [], self.model)


@dataclass(frozen=True)
class CyclePlan:
    """What a group's next cycle does: one RowPlan per row, in group order, and the model drafts."""

    rows: list[RowPlan]
    model_k: int  # draft forwards for the rows without copied drafts (0: none)
    vocab: int = 0  # the model drafts' head size (0: the full head)
    skip: frozenset[int] = frozenset()  # the layers the model drafts bypass

    @property
    def drafts_anything(self) -> bool:
        return self.model_k > 0 or any(r.copies for r in self.rows)


class DraftController:
    """Draft decisions of one CausalLM (see module docstring)."""

    def __init__(self, costs: Callable[[], CostModel], max_draft: int, ngram: bool, dtype: str = "float32",
                 kernels: str = "none", tuning: DraftTuning | None = None) -> None:
        self.costs = costs
        self.tuning = tuning or DraftTuning()
        self.max_draft = max_draft
        self.ngram = ngram  # n-gram drafts for speculating requests
        self.dtype = dtype  # the runner's compute dtype and CPU kernels set the multi-row bar (min_gain_rows)
        self.kernels = kernels
        self.force = False  # benchmarks/tests: always draft (no pay check, no auto-off)
        self.rules: dict[str, RuleRecord] = {}

    def rows_bar(self) -> float:
        """The multi-row bar of this runner (DraftTuning.rows_bar)."""
        return self.tuning.rows_bar(self.dtype, self.kernels)

    def rule(self, name: str, prior: float | None) -> RuleRecord:
        record = self.rules.get(name)
        if record is None:
            record = self.rules[name] = RuleRecord(self.tuning.unknown_prior if prior is None else prior, self.tuning)
        return record

    def admits(self, name: str, prior: float | None) -> bool:
        """Whether a new request of rule `name` drafts with the model (disabled rules: probes only)."""
        record = self.rule(name, prior)
        if not record.disabled or self.force:
            return True
        record.admitted_while_disabled += 1
        return record.admitted_while_disabled % self.tuning.probe_every == 0

    def acceptance(self, spec: SpecState) -> float:
        """The request's per-draft acceptance: its own counts over its rule's pooled estimate from
        other requests (counting its drafts in both would make one rejection weigh twice, enough
        to sink a prior below the pay line for good). Until it has min_cycles_before_auto_off
        cycles of its own (the same number auto-off waits for), the rule's estimate alone."""
        record = self.rules.get(spec.rule)
        prior = record.estimate(excluding=spec.model) if record is not None else self.tuning.unknown_prior
        if spec.model.cycles < self.tuning.min_cycles_before_auto_off:
            return prior
        return spec.model.estimate(prior, self.tuning.request_prior_weight)

    def plan_cycle(self, states: Sequence[DraftingRow]) -> CyclePlan:
        """The group's next cycle (rows in group order). Rows whose plans draft with different
        layers share one draft forward: it bypasses the layers all of them bypass (fewer layers
        bypassed never lowers a draft's acceptance, only raises its cost)."""
        cost, n = self.costs(), len(states)
        context = max(len(s.all_ids) for s in states)  # the group's cached columns (rows left-padded)
        copied = [RowPlan(s, self._ngram(s, cost, n, context)) for s in states]
        wants = [r for r in copied if r.state.spec is not None and r.state.spec.model_drafting and not r.copies]
        draft_skip = frozenset.intersection(*(r.spec.skip for r in wants)) if wants else frozenset()
        rows = [RowPlan(r.state, r.copies, model=bool(draft_skip) and r in wants) for r in copied] if wants else copied
        drafters = [r for r in rows if r.model]
        if not drafters:
            return self._watch(self._worth_it(CyclePlan(rows, 0), cost, context))
        # a row asking for the full head gets it (a larger head is never less exact)
        vocab = 0 if any(r.spec.vocab == 0 for r in drafters) else max(r.spec.vocab for r in drafters)
        draft = cost.draft_s(n, draft_skip, vocab, context)
        longest_copy = max(len(r.copies) for r in rows)

        # Expected tokens per k: the other rows' are fixed, each model row's acceptance read once.
        # Sampled rows also pay a token choice (cost.sample_s) per position: a model row at each
        # of its k drafts and at each position verification decides (its tokens).
        others = [(self._expected(r), r.sampled) for r in rows if not r.model]
        fixed = sum(tokens for tokens, _ in others)
        fixed_choices = sum(tokens for tokens, sampled in others if sampled)
        accepts = [self.acceptance(r.spec) for r in drafters]
        sampled = [a for a, r in zip(accepts, drafters, strict=True) if r.sampled]

        def seconds(k: int) -> float:
            choices = fixed_choices + sum(k + tokens_per_cycle(a, k) if k else 1.0 for a in sampled)
            return cost.cycle_s(n, k, draft, max(k, longest_copy), context) + cost.sample_s * choices

        rate = [(fixed + (sum(tokens_per_cycle(a, k) for a in accepts) if k else len(accepts))) / seconds(k)
                for k in range(self.max_draft + 1)]
        best = max(range(1, self.max_draft + 1), key=rate.__getitem__)
        tuning = self.tuning
        bar = tuning.min_gain if n == 1 else self.rows_bar()
        if not self.force and rate[best] < bar * rate[0]:
            learning = n <= max(cost.batched, default=1) and any(
                r.spec.model.drafted < tuning.request_prior_weight for r in drafters)
            if not (learning and rate[best] >= tuning.learn_floor * rate[0]):
                best = 0
        return self._watch(self._worth_it(CyclePlan(rows, best, vocab, draft_skip), cost, context))

    def _ngram(self, state: DraftingRow, cost: CostModel, rows: int, context: int) -> list[int]:
        """The row's copied drafts: as many as pay at this batch's size (force: the most allowed)."""
        spec = state.spec
        if spec is None or not self.ngram:
            return []
        copies = spec.index.lookup(state.all_ids, self.max_draft)
        if not copies or self.force:
            return copies
        best = cost.best_free_k(self._copy_acceptance(spec), rows, self.max_draft, self.tuning.min_gain, context)[0]
        return copies[:best]

    def _watch(self, plan: CyclePlan) -> CyclePlan:
        """Rows that draft copies drop their pending watch (the drafted cycle counts those tokens);
        the others, with no watch pending, watch their match: copies at their prior rarely pay in a
        batch, and a watch measures their acceptance without paying for a verification."""
        if not self.ngram:
            return plan
        for row in plan.rows:
            state, spec = row.state, row.state.spec
            if spec is None:
                continue
            if row.copies:
                spec.watch = None
            elif spec.watch is None:
                watched = spec.index.lookup(state.all_ids, self.max_draft)
                spec.watch = Watch(len(state.all_ids), watched) if watched else None
        return plan

    def observe(self, state: DraftingRow) -> None:
        """After a step (its tokens appended): settle the row's watch once its tokens decide it."""
        spec = state.spec
        if spec is None or spec.watch is None:
            return
        settled = spec.watch.settle(state.all_ids)
        if settled is not None:
            spec.watched.record(*settled)
            spec.watch = None

    def _copy_acceptance(self, spec: SpecState) -> float:
        return copy_acceptance(spec, self.tuning.ngram_prior)

    def _expected(self, row: RowPlan) -> float:
        """A row's expected tokens in a cycle where it takes no model drafts: its copies', or one."""
        spec = row.state.spec
        if spec is None or not row.copies:
            return 1.0
        return tokens_per_cycle(self._copy_acceptance(spec), len(row.copies))

    def _worth_it(self, plan: CyclePlan, cost: CostModel, context: int) -> CyclePlan:
        """Drop copied drafts when the cycle they cost is slower than a plain step (batch effects)."""
        if self.force or not any(r.copies for r in plan.rows) or plan.model_k:
            return plan
        n = len(plan.rows)
        # A batch advances at its slowest row's pace: copies that only some rows have make every
        # row's step cost more while the batch's step count stays bound by the rows without them,
        # so a copying cycle must pay for its least-served row.
        tokens = n * min(self._expected(r) for r in plan.rows)
        longest = max(len(r.copies) for r in plan.rows)
        plain = n / cost.full_s(n, 1, context)
        if tokens / cost.full_s(n, longest + 1, context) > self.tuning.min_gain * plain:
            return plan
        return CyclePlan([r.without_copies() for r in plan.rows], 0)

    def record(self, state: DraftingRow, source: str, drafted: int, accepted: int) -> bool:
        """Count one row's cycle; True when the request's model drafting should stop (auto-off)."""
        spec = state.spec
        if spec is None or drafted == 0:
            return False
        if source == "ngram":
            spec.ngram.record(drafted, accepted)
            return False
        spec.model.record(drafted, accepted)
        spec.k = drafted
        rule = self.rule(spec.rule, None)
        rule.record(drafted, accepted)
        self._judge_rule(spec.rule, rule, spec)
        if self.force or spec.model.cycles < self.tuning.min_cycles_before_auto_off:
            return False
        _, speedup = self.costs().best_k(self.acceptance(spec), spec.skip, spec.vocab, 1, self.max_draft,
                                         len(state.all_ids))
        return speedup < 1.0

    def _judge_rule(self, name: str, rule: RuleRecord, spec: SpecState) -> None:
        if rule.counts.cycles < self.tuning.min_rule_cycles or self.force:
            return
        _, speedup = self.costs().best_k(rule.estimate(), spec.skip, spec.vocab, 1, self.max_draft)
        if speedup < 1.0 and not rule.disabled:
            rule.disabled = True
            logger.warning(f"Layer-skip rule {name!r}: measured acceptance {rule.estimate():.2f} makes drafting "
                           f"{speedup:.2f}x plain decoding; its drafting is off for new requests (probing 1 in "
                           f"{self.tuning.probe_every})")
        elif speedup >= 1.0 and rule.disabled:
            rule.disabled = False
            logger.info(f"Layer-skip rule {name!r}: acceptance recovered to {rule.estimate():.2f} "
                        f"({speedup:.2f}x plain decoding); drafting is on again")
