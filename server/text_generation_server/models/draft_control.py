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
  starting from the policy's calibrated acceptance as a prior worth RULE_PRIOR_WEIGHT drafts.
  When a rule's expected speed at batch 1 falls below plain decoding after MIN_RULE_CYCLES
  cycles, its model drafting is disabled for new requests (logged once); one new request in
  PROBE_EVERY still drafts, so the rule is re-enabled when its acceptance recovers;
- per request (the floor, "auto-off"): a request whose own acceptance (with its rule's as the
  prior) makes its drafting slower than plain decoding after MIN_CYCLES_BEFORE_AUTO_OFF cycles
  stops model drafting; its n-gram drafts go on when they pay. Until its own drafts weigh as much
  as its prior (REQUEST_PRIOR_WEIGHT), a request drafts even when the prior puts its group's cycle
  just short of paying (within LEARN_FLOOR; groups only up to the row counts the cost model
  measured): a prior near the line would otherwise decide for good, from one warm-up reading or
  from another class's drafts under the same rule, without the request's own evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger

from .batch import RequestState
from .cost_model import MAX_DRAFT, CostModel, tokens_per_cycle
from .ngram import Watch
from .speculative import MIN_CYCLES_BEFORE_AUTO_OFF, Counts, SpecState

MAX_SPECULATE = 16  # --speculate limit (a verification of 17 tokens per row)
MIN_RULE_CYCLES = 16
PROBE_EVERY = 16
UNKNOWN_PRIOR = 0.6  # a rule without a calibrated acceptance: optimistic enough to be tried
NGRAM_PRIOR = 0.5
REQUEST_PRIOR_WEIGHT = 4.0  # the rule's estimate counts as this many observed drafts of a request
# The policy's calibrated acceptance counts as this many drafts in a rule's pooled estimate: with 4,
# one request's two rejected first drafts took the 0.5B's rule from 0.73 to 0.49, below the pay
# line, and no later request of any class drafted again (a rule that never drafts never reaches
# MIN_RULE_CYCLES to be judged and probed); with MIN_RULE_CYCLES, evidence outweighs the
# calibration only when the rule may be judged.
RULE_PRIOR_WEIGHT = float(MIN_RULE_CYCLES)
DECAY_AT = 512  # pooled counts are halved past this many cycles (recent requests weigh more)
# A cycle drafts only when its expected speed beats a plain step by this factor: the cost model is
# measured once at warm-up on a shared machine, and its figures move by about 5% between runs.
MIN_GAIN = 1.05
# A cycle in which some model row has fewer than REQUEST_PRIOR_WEIGHT drafts of its own drafts when
# it is predicted within this factor of plain decoding's speed, short of its bar: the rows' own
# acceptance then decides (a learning cycle is predicted at most 5% slower than a plain step, and
# each request has few). On the 0.5B the chat rule's prior (0.83, 4 layers, a 0.65-step draft)
# is predicted at 1.04-1.10x depending on one warm-up's verify(2) reading (1.0-1.07); code
# completion prompts under 120 tokens take that rule and accept 0.92 as served (1.23x off when
# they draft, 0.99x when the reading kept them from it). In groups (since 2026-12-05): on the 1.5B
# in bf16, code completion's first batch-4 drafts (4 of 20 kept) sank the default rule, which
# chat shares, to ~0.5; nothing at batch 4 drafted with it again and chat ran 0.99x off. With
# groups learning, code completion then chat at batch 4: 1.35x (292 drafts, 0.70 kept) and 1.15x
# (336, 0.84). (Learning was batch 1 only while 4-row cycles cost ~1.2x their warm-up price: the
# 1-draft cycles it then kept at batch 4 ran 0.90x off. The cost model now prices attention by
# context, and MIN_GAIN_ROWS guards the rest.) Groups learn only up to the row counts whose forwards
# the cost model measured (4); larger ones are priced by extrapolation, and with requests arriving
# as others finished (0.5B bf16, classes mixed) groups of 8 that learned ran 0.97x off, 1.04x
# without, while groups of 4 ran 1.12x with it and 1.05x without.
LEARN_FLOOR = 0.95
# Model drafts in a group of several rows must beat plain steps by this factor, per compute dtype
# (and kernels).
# Served 4-row cycles of the 0.5B once cost 1.2-1.4x their warm-up price (code completion at batch 4
# ran 0.84-0.93x off at 1.05), so the bar was 1.25, and batch 4 then never drafted (0.99x off). Since
# the x-row tiles and the blocked attention (2026-12-04, quiet machine) float32 4-row model cycles
# cost 0.97-1.00x their price at ~170 cached tokens and 1.07-1.24x at ~1250 (0.99-1.04x since the
# cost model prices attention by context); at a bar of 1.05-1.15 float32 code completion at batch 4
# ran 1.25-1.31x off, chat 0.94-1.06x, summarisation 1.00-1.06x. The bar stays above MIN_GAIN
# because 4-row prices (arithmetic-bound) move more between warm-ups than one-row ones. bfloat16
# at 1.15 ran 0.87x (code completion) and 0.94x (chat): its 4-row cycles still cost more than their
# price, so it keeps 1.25, as does any other dtype, except on the amx kernels (keys "dtype/variant"
# come first): there, 2026-12-05, bfloat16 at 1.15 ran batch 4 at 1.35x / 1.20x off (1.5B / 0.5B
# code completion), 1.13x / 1.08x (chat), 1.08x / 1.02x (summarisation), against 0.99-1.20x,
# 0.98-1.00x and 0.98-1.03x at 1.25 (drafts on int8 tiles at 0.33-0.55 of a 4-row step, 4-row
# verifications of 2-4 tokens at 1.03-1.17 steps). Where a multi-row verification costs about a
# step (a GPU) drafts clear either bar. Copies keep MIN_GAIN at any batch size: with bf16's 1.25 at
# 4 rows (2026-12-05) the 1.5B's code completion ran 1.15x off (copies accepted 0.64, 168 drafted)
# against 1.20x at 1.05 (216 drafted), the 0.5B's summarisation 0.98x against 1.03x, and the chat
# copies it stopped (accepted 0.25-0.5, saving no step) had cost under 0.5% of the steps.
MIN_GAIN_ROWS = {"float32": 1.15, "bfloat16/amx": 1.15}
MIN_GAIN_ROWS_OTHER = 1.25  # bfloat16 and any other dtype


@dataclass(frozen=True)
class SpeculateConfig:
    """Speculation settings of a shard.

    Attributes:
        speculate: upstream's `--speculate N`: n-gram drafts of up to N tokens per step for every
            request (off and shadow too), and N the longest draft of verified mode as well.
            None (not given): n-gram drafts only in verified mode, drafts up to MAX_DRAFT.
    """

    speculate: int | None = None

    def __post_init__(self) -> None:
        if self.speculate is not None and not 1 <= self.speculate <= MAX_SPECULATE:
            raise ValueError(f"--speculate {self.speculate}: use 1..{MAX_SPECULATE} draft tokens per step")

    @property
    def max_draft(self) -> int:
        return self.speculate or MAX_DRAFT

    @property
    def ngram_for_all(self) -> bool:
        return self.speculate is not None


def copy_acceptance(spec: SpecState) -> float:
    """A request's per-draft acceptance of its copies, drafted and watched, over NGRAM_PRIOR."""
    return spec.ngram.plus(spec.watched).estimate(NGRAM_PRIOR)


@dataclass
class RuleRecord:
    """One rule's pooled model-draft statistics."""

    prior: float
    counts: Counts = field(default_factory=Counts)
    disabled: bool = False
    admitted_while_disabled: int = 0

    def estimate(self, excluding: Counts | None = None) -> float:
        """Pooled acceptance, optionally without one request's own counts (its prior)."""
        counts = self.counts if excluding is None else self.counts.without(excluding)
        return counts.estimate(self.prior, RULE_PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        self.counts.record(drafted, accepted)
        if self.counts.cycles > DECAY_AT:
            c = self.counts
            self.counts = Counts(c.cycles // 2, c.drafted // 2, c.accepted // 2, c.rejections // 2)


@dataclass(frozen=True)
class CyclePlan:
    """What a group's next cycle does: per row its copied drafts, and the model-draft length."""

    ngram: list[list[int]]  # per row, in group order; empty = none
    model_k: int  # draft forwards for the rows without copied drafts (0: none)
    model_rows: list[bool]  # per row: takes the model's drafts
    vocab: int = 0  # the model drafts' head size (0: the full head)
    skip: frozenset[int] = frozenset()  # the layers the model drafts bypass

    @property
    def drafts_anything(self) -> bool:
        return self.model_k > 0 or any(self.ngram)


class DraftController:
    """Draft decisions of one CausalLM (see module docstring)."""

    def __init__(self, costs: Callable[[], CostModel], max_draft: int, ngram: bool, dtype: str = "float32",
                 kernels: str = "none") -> None:
        self.costs = costs
        self.max_draft = max_draft
        self.ngram = ngram  # n-gram drafts for speculating requests
        self.dtype = dtype  # the runner's compute dtype and CPU kernels set the multi-row bar (MIN_GAIN_ROWS)
        self.kernels = kernels
        self.force = False  # benchmarks/tests: always draft (no pay check, no auto-off)
        self.rules: dict[str, RuleRecord] = {}

    def rows_bar(self) -> float:
        """MIN_GAIN_ROWS for this runner: its dtype on its kernels, else its dtype, else the default."""
        return MIN_GAIN_ROWS.get(f"{self.dtype}/{self.kernels}", MIN_GAIN_ROWS.get(self.dtype, MIN_GAIN_ROWS_OTHER))

    def rule(self, name: str, prior: float | None) -> RuleRecord:
        record = self.rules.get(name)
        if record is None:
            record = self.rules[name] = RuleRecord(UNKNOWN_PRIOR if prior is None else prior)
        return record

    def admits(self, name: str, prior: float | None) -> bool:
        """Whether a new request of rule `name` drafts with the model (disabled rules: probes only)."""
        record = self.rule(name, prior)
        if not record.disabled or self.force:
            return True
        record.admitted_while_disabled += 1
        return record.admitted_while_disabled % PROBE_EVERY == 0

    def acceptance(self, spec: SpecState) -> float:
        """The request's per-draft acceptance: its own counts over its rule's pooled estimate from
        other requests (counting its drafts in both made one rejection weigh twice: a first draft
        rejected took a 0.73 prior to 0.47, below the pay line, and the request never drafted
        again to learn otherwise). Until it has MIN_CYCLES_BEFORE_AUTO_OFF cycles of its own (the
        same number auto-off waits for), the rule's estimate alone."""
        record = self.rules.get(spec.rule)
        prior = record.estimate(excluding=spec.model) if record is not None else UNKNOWN_PRIOR
        if spec.model.cycles < MIN_CYCLES_BEFORE_AUTO_OFF:
            return prior
        return spec.model.estimate(prior, REQUEST_PRIOR_WEIGHT)

    def plan_cycle(self, states: list[RequestState]) -> CyclePlan:
        """The group's next cycle (rows in group order). Rows whose plans draft with different
        layers share one draft forward: it bypasses the layers all of them bypass (fewer layers
        bypassed never lowers a draft's acceptance, only raises its cost)."""
        cost, rows = self.costs(), len(states)
        context = max(len(s.all_ids) for s in states)  # the group's cached columns (rows left-padded)
        ngram = [self._ngram(s, cost, rows, context) for s in states]
        wants = [s.spec is not None and s.spec.model_drafting and not ng for s, ng in zip(states, ngram, strict=True)]
        drafting = [s.spec.skip for s, w in zip(states, wants, strict=True) if w and s.spec is not None]
        draft_skip = frozenset.intersection(*drafting) if drafting else frozenset()
        model_rows = [w and bool(draft_skip) for w in wants]
        if not any(model_rows):
            return self._watch(self._worth_it(CyclePlan(ngram, 0, model_rows), states, cost, context), states)
        vocab = max((s.spec.vocab for s, m in zip(states, model_rows, strict=True) if m and s.spec), default=0)
        if any(s.spec.vocab == 0 for s, m in zip(states, model_rows, strict=True) if m and s.spec):
            vocab = 0  # a row asking for the full head gets it (a larger head is never less exact)
        draft = cost.draft_s(rows, draft_skip, vocab, context)
        longest_copy = max((len(ng) for ng in ngram), default=0)

        # Expected tokens per k: the other rows' are fixed, each model row's acceptance read once.
        # Sampled rows also pay a token choice (cost.sample_s) per position: a model row at each
        # of its k drafts and at each position verification decides (its tokens).
        others = [(self._expected(s, ng), s.chooser.params.sampling)
                  for s, ng, m in zip(states, ngram, model_rows, strict=True) if not m]
        fixed = sum(tokens for tokens, _ in others)
        fixed_choices = sum(tokens for tokens, sampled in others if sampled)
        drafters = [(s, s.spec) for s, m in zip(states, model_rows, strict=True) if m and s.spec]
        accepts = [self.acceptance(spec) for _, spec in drafters]
        sampled = [a for a, (s, _) in zip(accepts, drafters, strict=True) if s.chooser.params.sampling]

        def seconds(k: int) -> float:
            choices = fixed_choices + sum(k + tokens_per_cycle(a, k) if k else 1.0 for a in sampled)
            return cost.cycle_s(rows, k, draft, max(k, longest_copy), context) + cost.sample_s * choices

        rate = [(fixed + (sum(tokens_per_cycle(a, k) for a in accepts) if k else len(accepts))) / seconds(k)
                for k in range(self.max_draft + 1)]
        best = max(range(1, self.max_draft + 1), key=rate.__getitem__)
        bar = MIN_GAIN if rows == 1 else self.rows_bar()
        if not self.force and rate[best] < bar * rate[0]:
            learning = rows <= max(cost.batched, default=1) and any(
                s.spec.model.drafted < REQUEST_PRIOR_WEIGHT for s, m in zip(states, model_rows, strict=True)
                if m and s.spec)
            if not (learning and rate[best] >= LEARN_FLOOR * rate[0]):
                best = 0
        plan = CyclePlan(ngram, best, model_rows, vocab, draft_skip)
        return self._watch(self._worth_it(plan, states, cost, context), states)

    def _ngram(self, state: RequestState, cost: CostModel, rows: int, context: int) -> list[int]:
        """The row's copied drafts: as many as pay at this batch's size (force: the most allowed)."""
        spec = state.spec
        if spec is None or not self.ngram:
            return []
        copies = spec.index.lookup(state.all_ids, self.max_draft)
        if not copies or self.force:
            return copies
        return copies[:cost.best_free_k(copy_acceptance(spec), rows, self.max_draft, MIN_GAIN, context)[0]]

    def _watch(self, plan: CyclePlan, states: list[RequestState]) -> CyclePlan:
        """Rows that draft copies drop their pending watch (the drafted cycle counts those tokens);
        the others, with no watch pending, watch their match. Measured on the 0.5B at batch 4, where
        a 4-row x 2-token forward costs 1.6-1.8 steps: copies at the prior never pay there, and
        before watches each request drafted its first match anyway to learn its acceptance (code
        completion 0.93x off, chat 0.94x, with these probes' cycles mostly rejected)."""
        if not self.ngram:
            return plan
        for state, copies in zip(states, plan.ngram, strict=True):
            spec = state.spec
            if spec is None:
                continue
            if copies:
                spec.watch = None
            elif spec.watch is None:
                watched = spec.index.lookup(state.all_ids, self.max_draft)
                spec.watch = Watch(len(state.all_ids), watched) if watched else None
        return plan

    def observe(self, state: RequestState) -> None:
        """After a step (its tokens appended): settle the row's watch once its tokens decide it."""
        spec = state.spec
        if spec is None or spec.watch is None:
            return
        settled = spec.watch.settle(state.all_ids)
        if settled is not None:
            spec.watched.record(*settled)
            spec.watch = None

    def _expected(self, state: RequestState, copied: list[int]) -> float:
        """A row's expected tokens in a cycle where it takes no model drafts: its copies', or one."""
        spec = state.spec
        if spec is None or not copied:
            return 1.0
        return tokens_per_cycle(copy_acceptance(spec), len(copied))

    def _worth_it(self, plan: CyclePlan, states: list[RequestState], cost: CostModel, context: int) -> CyclePlan:
        """Drop copied drafts when the cycle they cost is slower than a plain step (batch effects)."""
        if self.force or not any(plan.ngram) or plan.model_k:
            return plan
        rows = len(states)
        # A batch advances at its slowest row's pace: copies that only some rows have make every
        # row's step cost more while the batch's step count stays bound by the rows without them
        # (0.5B chat at batch 4, two of four rows copying, copies accepted 0.70: 186 of 189 steps
        # left, 0.69x off), so a copying cycle must pay for its least-served row.
        tokens = rows * min(self._expected(s, ng) for s, ng in zip(states, plan.ngram, strict=True))
        longest = max(len(ng) for ng in plan.ngram)
        if tokens / cost.full_s(rows, longest + 1, context) > MIN_GAIN * rows / cost.full_s(rows, 1, context):
            return plan
        return CyclePlan([[] for _ in states], 0, plan.model_rows)

    def record(self, state: RequestState, source: str, drafted: int, accepted: int) -> bool:
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
        if self.force or spec.model.cycles < MIN_CYCLES_BEFORE_AUTO_OFF:
            return False
        _, speedup = self.costs().best_k(self.acceptance(spec), spec.skip, spec.vocab, 1, self.max_draft,
                                         len(state.all_ids))
        return speedup < 1.0

    def _judge_rule(self, name: str, rule: RuleRecord, spec: SpecState) -> None:
        if rule.counts.cycles < MIN_RULE_CYCLES or self.force:
            return
        _, speedup = self.costs().best_k(rule.estimate(), spec.skip, spec.vocab, 1, self.max_draft)
        if speedup < 1.0 and not rule.disabled:
            rule.disabled = True
            logger.warning(f"Layer-skip rule {name!r}: measured acceptance {rule.estimate():.2f} makes drafting "
                           f"{speedup:.2f}x plain decoding; its drafting is off for new requests (probing 1 in "
                           f"{PROBE_EVERY})")
        elif speedup >= 1.0 and rule.disabled:
            rule.disabled = False
            logger.info(f"Layer-skip rule {name!r}: acceptance recovered to {rule.estimate():.2f} "
                        f"({speedup:.2f}x plain decoding); drafting is on again")
