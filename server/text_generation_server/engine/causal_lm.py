"""CausalLM: one generation step over a cached batch.

`generate_token` reads like the request path: plan (new requests' skip plans, each group's
step) -> forward (every group) -> choose tokens (every group, which then advances) -> stop
checks and generations, each stage timed apart (step_timing.py). Generations are plain
dataclasses; the servicer turns them into protobuf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from ..detokenize import decode_token
from ..grammar import GrammarCompiler
from ..grammar_limits import GrammarLimits
from ..layerskip import LayerSkipMode, SkipPlan
from ..models.loading import dtype_name
from ..models.runner.base import ForwardInputs, Runner
from ..sampling import top_n_tokens
from ..sampling.chooser import failure_message
from ..speculative.controller import DraftController, SpeculateConfig
from ..speculative.cost_model import DraftKey, LazyCosts
from ..speculative.draft_head import DraftHeads
from ..speculative.state import SpecState
from ..stopping import FinishReason
from . import memory
from .audit_check import add_twins, compare_twins
from .batch import NO_SKIP, CausalLMBatch, RequestState
from .group_step import ChunkStep, GroupStep, PlainStep, RowStep, VerifiedStep
from .plan_groups import GroupKey, PlanGroup
from .prefix_cache import MIN_TOKENS, PrefixCache
from .skip_planner import PolicyState, SkipPlanner
from .step_timing import Stage, StageClock, StepTimings

SHARED_PREFIX_TOKENS = 64  # prompts of one batch sharing at least this many first tokens run them once


def shared_prefixes(prompts: list[list[int]]) -> list[list[int]]:
    """The longest prefixes (of at least SHARED_PREFIX_TOKENS tokens, short of any prompt's last
    token) that two or more of `prompts` share, none a prefix of another."""
    ordered = sorted(prompts)
    found: list[list[int]] = []
    for a, b in zip(ordered, ordered[1:], strict=False):
        stop = min(len(a), len(b)) - 1
        agree = next((i for i in range(stop) if a[i] != b[i]), stop)
        if agree >= max(SHARED_PREFIX_TOKENS, MIN_TOKENS):
            found.append(a[:agree])
    return [p for p in found if not any(len(q) > len(p) and q[:len(p)] == p for q in found)]


@dataclass
class TokenInfo:
    """Parallel lists of token ids, logprobs, texts and special flags (the proto's Tokens)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    is_special: list[bool] = field(default_factory=list)


@dataclass
class FinishedText:
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None


@dataclass
class Generation:
    """What one request produced in one step."""

    request_id: int
    tokens: TokenInfo
    prefill_tokens: TokenInfo | None = None
    top_tokens: list[TokenInfo] = field(default_factory=list)
    generated_text: FinishedText | None = None
    layer_skip: LayerSkipReport | None = None
    error: str | None = None  # this request failed alone in this step (it is finished, no tokens)
    cached_tokens: int | None = None  # on the first generation: prompt tokens taken from the prefix cache


@dataclass
class LayerSkipReport:
    """A request's plan, reported on its first and its last generation (when its mode is not off)."""

    mode: str
    skipped_layers: list[int]
    rule: str
    scores: dict[str, float]
    stats: dict[str, float]


def layer_skip_report(state: RequestState) -> LayerSkipReport | None:
    """The request's plan, with its decision time and (verified mode) drafting statistics."""
    plan = state.plan
    if plan is None or plan.mode == LayerSkipMode.OFF:
        return None
    stats = {"decision_ms": state.decision_ms}
    spec = state.spec
    if spec is not None:
        stats.update(drafted=spec.drafted, accepted=spec.accepted, cycles=spec.cycles, draft_length=spec.k,
                     acceptance=spec.accepted / spec.drafted if spec.drafted else 0.0,
                     auto_off=float(spec.auto_off), ngram_drafted=spec.ngram.drafted,
                     ngram_accepted=spec.ngram.accepted, model_drafted=spec.model.drafted,
                     model_accepted=spec.model.accepted, draft_vocab=spec.vocab)
    return LayerSkipReport(plan.mode, sorted(plan.skipped), plan.rule, dict(plan.scores), stats)


class CausalLM:
    """A loaded model with its tokenizer, runner and skip planner, able to run batches."""

    def __init__(self, runner: Runner, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                 planner: SkipPlanner, max_position_embeddings: int = 4096,
                 speculation: SpeculateConfig | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.planner = planner
        self.max_position_embeddings = max_position_embeddings
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.speculation = speculation or SpeculateConfig()
        policy = planner.scheduler.policy
        self.heads = DraftHeads(policy.draft_vocab, runner)
        for rule in (*policy.table.rules, policy.table.default):
            self.heads.reserve(rule.draft.vocab)
        table = policy.table
        drafts: list[DraftKey] = [(r.skip, r.draft.vocab) for r in (*table.rules, table.default) if r.skip]
        # the draft/verify cost model of the policy's draft configurations (measured once)
        self.costs = LazyCosts(runner, drafts, self.heads, max_tokens=4 * (self.speculation.max_draft + 1))
        self.controller = DraftController(self.costs, self.speculation.max_draft, ngram=True,
                                          dtype=dtype_name(runner.dtype), kernels=runner.cpu_kernels,
                                          tuning=self.speculation.tuning)
        self._grammars: GrammarCompiler | None = None
        self.pools = runner.pools  # the batches' paged KV, one pool per skip set
        # set by `serve` from the shard's environment (PREFIX_CACHING, PREFILL_CHUNK_TOKENS)
        self.prefixes: PrefixCache | None = None  # reused prompt prefixes (None: every prompt runs whole)
        self.prefill_chunk = 0  # prompt tokens a group's step may run (0: a prefill runs at once)

    def memory(self) -> dict[str, int]:
        """Where the shard's memory goes, by part (engine/memory.py)."""
        parts = {**self.runner.memory_parts(), "draft_heads": self.heads, "planner": self.planner}
        return memory.account(parts, self.pools, self.prefixes)

    def grammar_compiler(self, limits: GrammarLimits | None = None) -> GrammarCompiler:
        """The model's grammar compiler: its logits width and EOS set (built once, as it reads the
        whole vocabulary, with the limits of the first call)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids),
                                             limits)
        return self._grammars

    @property
    def auto_off(self) -> bool:
        """Whether drafting that does not pay stops (False: always draft, for tests and benchmarks)."""
        return not self.controller.force

    @auto_off.setter
    def auto_off(self, value: bool) -> None:
        self.controller.force = not value

    @property
    def speculate(self) -> int:
        """Info.speculate: the most draft tokens a step may verify per request (0: no speculation).

        As upstream's router reads it: up to this many tokens beyond one per step (KV columns).
        """
        possible = (self.speculation.ngram_for_all or self.planner.policy_state == PolicyState.LOADED
                    or self.planner.mode == LayerSkipMode.VERIFIED)
        return self.speculation.max_draft if possible else 0

    def generate_token(self, batch: CausalLMBatch) -> tuple[list[Generation], CausalLMBatch | None, StepTimings]:
        """Run one step; returns the generations, the batch to cache (None if all stopped) and timings."""
        clock = StageClock()
        with clock.stage(Stage.PLAN):
            new = not batch.groups
            if new:
                self.plan(batch)
            prefilling = [g for g in batch.groups if g.fresh]
            group_steps = self.group_steps(batch, defer_chunks=new)
        with clock.stage(Stage.FORWARD):
            for group_step in group_steps:
                group_step.forward(clock)
        with clock.stage(Stage.CHOOSE):
            steps = {rid: row for group_step in group_steps for rid, row in group_step.choose().items()}
        with clock.stage(Stage.STOP):
            generations = self.generations(batch, steps)
            self.adapt_drafting(batch, steps)
            generations = self.check_audit_twins(batch, generations)
            self.keep_prefixes(batch, [g for g in prefilling if not g.fresh],
                               {g.request_id for g in generations if g.generated_text})
        alive = any(not s.finished for s in batch.requests)
        return generations, (batch if alive else None), clock.timings()

    def plan(self, batch: CausalLMBatch) -> None:
        """Decide each request's SkipPlan and group the batch's rows by the layers they skip."""
        keys: dict[int, GroupKey] = {}
        for state in batch.requests:
            plan = state.plan = self.planner.plan(state)
            plan.check_layers(self.runner.num_layers)
            state.spec = self.speculation_for(plan)
            # verification runs the full model: verified rows share the full group (see plan_groups)
            keys[state.id] = NO_SKIP if plan.mode == LayerSkipMode.VERIFIED else plan.applied
        if self.planner.monitor is not None:
            add_twins(batch, self.planner.monitor)
            keys.update((s.id, NO_SKIP) for s in batch.requests if s.audit_of is not None)
        if self.prefixes is not None:
            self.run_shared_prefixes(batch, keys, self.prefixes)
        batch.form_groups(keys, self.pools, self.prefixes)

    def run_shared_prefixes(self, batch: CausalLMBatch, keys: dict[int, GroupKey], prefixes: PrefixCache) -> None:
        """Run once, and cache, the prompt prefixes that requests of a new batch share (a document
        or a system prompt sent with each), so that their prefill reuses them instead of running
        them once per row."""
        prompts: dict[GroupKey, list[list[int]]] = {}
        for state in batch.requests:
            if not state.prefill_logprobs:
                prompts.setdefault(keys[state.id], []).append(state.all_ids[: state.input_length])
        for key, group in prompts.items():
            for shared in shared_prefixes(group):
                hit = prefixes.lookup(key, shared, count=False)
                if hit is not None and hit.length >= len(shared) - 1:
                    continue
                row = PlanGroup.from_prompts(key, [0], [shared], self.pools(key), batch.pad_id, [hit])
                self.runner.bypassing(key, self.planner.biases).forward(ForwardInputs(*row.forward_inputs()),
                                                                         row.cache)
                row.advance([0])
                prefixes.insert(key, shared, row.row_kv(0))

    def speculation_for(self, plan: SkipPlan) -> SpecState | None:
        """A new request's drafters: verified plans draft with their rule's draft model (unless the
        rule's drafting is switched off) and n-gram copies; with --speculate, off and shadow
        requests draft n-gram copies too. None: plain decoding."""
        if self.speculate == 0 or plan.mode == LayerSkipMode.LOSSY:
            return None
        if plan.mode == LayerSkipMode.VERIFIED:
            admitted = bool(plan.skipped) and self.controller.admits(plan.rule, plan.draft.acceptance)
            return SpecState(rule=plan.rule, skip=plan.skipped if admitted else frozenset(), vocab=plan.draft.vocab)
        return SpecState(rule=plan.rule) if self.speculation.ngram_for_all else None

    def group_steps(self, batch: CausalLMBatch, defer_chunks: bool = False) -> list[GroupStep]:
        """One step per plan group: a plain forward, a chunk of a long prefill, or a draft-verify
        cycle where rows speculate.

        Groups hold disjoint requests, so every group's step is planned before any forward
        runs, and every forward before any choice, with the same tokens as one group at a time.
        `defer_chunks` (the step that forms the groups, a Prefill): a group to be prefilled in
        chunks runs none yet; its first chunk runs in the next step, beside the running batch's,
        so that a running request waits for one chunk and not for two."""
        by_id = {s.id: s for s in batch.requests}
        audited = {s.audit_of for s in batch.requests if s.audit_of is not None}
        out: list[GroupStep] = []
        for group in batch.groups:
            states = [by_id[rid] for rid in group.request_ids]
            width = self.chunk_width(group, states, audited)
            if width:
                if not defer_chunks:
                    for state in states:
                        state.chunk_len = None  # it bounded the first chunk only
                    scored = any(s.prefill_logprobs for s in states)
                    out.append(ChunkStep(self.runner, group, width, self.planner.biases, scored))
                continue
            if not group.fresh and any(s.spec is not None for s in states):
                cycle = self.controller.plan_cycle(states)
                if cycle.drafts_anything:
                    head = self.heads.get(cycle.vocab) if cycle.model_k else None
                    out.append(VerifiedStep(self.runner, group, states, cycle, self.planner.biases, head))
                    continue
            out.append(PlainStep(self.runner, group, states, self.planner.biases))
        return out

    def chunk_width(self, group: PlanGroup, states: list[RequestState], audited: set[int]) -> int:
        """The pending columns a prefilling group runs this step when its prompts are longer than
        `prefill_chunk` tokens or a router's chunk_len (a first chunk's bound); 0: it runs them
        all and chooses its first tokens. Chunks keep the running requests' steps going while a
        long prompt is prefilled (prompt logprobs are scored chunk by chunk). Audit twins and
        the requests they audit keep their groups whole (compared token for token, step by step)."""
        if not group.fresh or not self.prefill_chunk:
            return 0
        if any(s.audit_of is not None or s.id in audited for s in states):
            return 0
        width = max(self.prefill_chunk // group.num_rows, 1)
        bounds = [s.chunk_len for s in states if s.chunk_len]  # the router's, on a first chunk
        if bounds:
            width = min(width, *bounds)
        return width if group.pending_ids.shape[1] > width else 0

    def adapt_drafting(self, batch: CausalLMBatch, steps: dict[int, RowStep]) -> None:
        """Count each drafting row's cycle (request and rule) and settle watched copies; a request
        whose model drafting does not pay stops drafting with the model (auto-off)."""
        for state in batch.requests:
            step = steps.get(state.id)
            if step is None or state.spec is None or state.finished:  # None: its prompt is still prefilling
                continue
            self.controller.observe(state)
            if step.drafted and self.controller.record(state, step.source, step.drafted, step.accepted):
                state.spec.auto_off = True

    def keep_prefixes(self, batch: CausalLMBatch, prefilled: list[PlanGroup], finished: set[int]) -> None:
        """Copy into the prefix cache the prompt of each request just prefilled and the whole
        sequence of each request that just `finished` (its answer included, for a chat's next
        turn). Audit twins and failed requests are not kept."""
        if self.prefixes is None:
            return
        just_prefilled = {rid for g in prefilled for rid in g.request_ids}
        by_id = {s.id: s for s in batch.requests}
        for group in batch.groups:
            for rid in group.request_ids:
                state = by_id[rid]
                if state.audit_of is not None or not (rid in finished or rid in just_prefilled and not state.finished):
                    continue
                layers = group.row_kv(rid)
                columns = max((kv[0].shape[1] for kv in layers if kv is not None), default=0)
                # the cache holds the sequence but its last token (a stop may have cut accepted drafts)
                n = min(len(state.all_ids), columns)
                self.prefixes.insert(group.skip, state.all_ids[:n],
                                     [None if kv is None else (kv[0][:, :n], kv[1][:, :n]) for kv in layers])

    def check_audit_twins(self, batch: CausalLMBatch, generations: list[Generation]) -> list[Generation]:
        """Hide the audit twins' generations, settle their comparisons, report the window."""
        monitor = self.planner.monitor
        if monitor is None:
            return generations
        twins = {s.id for s in batch.requests if s.audit_of is not None}
        if twins and compare_twins(batch, monitor):
            self.planner.roll_back()
        shown = [g for g in generations if g.request_id not in twins]
        for g in shown:
            if g.layer_skip is not None and g.generated_text is not None:
                g.layer_skip.stats.update(shadow_consistency=monitor.consistency, shadow_checks=len(monitor.results),
                                          rollbacks=monitor.rollbacks)
        return shown

    def generations(self, batch: CausalLMBatch, steps: dict[int, RowStep]) -> list[Generation]:
        """One Generation per live request. A request whose token choice failed, or whose step
        cannot be recorded (detokenization, stop checks), ends alone with its own message; the
        others go on."""
        out = []
        for state in batch.requests:
            if state.finished or state.id not in steps:  # not in steps: its prompt is still prefilling
                continue
            step, error = steps[state.id], steps[state.id].error
            if error is None:
                try:
                    out.append(self.request_generation(state, step))
                    continue
                except Exception as err:  # noqa: BLE001 - one request's failure must not fail the batch
                    error = failure_message(err)
            state.finished = True
            out.append(Generation(state.id, TokenInfo(), error=error))
        return out

    def request_generation(self, state: RequestState, step: RowStep) -> Generation:
        """Record the step's tokens one by one, detokenizing and checking stopping after each."""
        first_step = not state.generated_ids
        prompt = step.prompt_logprobs
        prefill = self.prefill_tokens(state, prompt) if prompt is not None and first_step else None
        tokens, top, finished = TokenInfo(), [], None
        for i, (token_id, logprob) in enumerate(zip(step.token_ids, step.logprobs, strict=True)):
            state.all_ids.append(token_id)
            state.generated_ids.append(token_id)
            text, state.prefix_offset, state.read_offset = decode_token(
                self.tokenizer, state.all_ids, state.prefix_offset, state.read_offset)
            tokens.ids.append(token_id)
            tokens.logprobs.append(logprob)
            tokens.texts.append(text)
            tokens.is_special.append(token_id in self.special_ids)
            if state.top_n_tokens:
                top.append(self.top_tokens(state, step.logits[i]))
            reason = state.stopping(token_id, text)
            if reason is not None:
                state.finished = True
                params = state.chooser.params
                finished = FinishedText(
                    str(self.tokenizer.decode(state.generated_ids, skip_special_tokens=True)),
                    len(state.generated_ids), reason, params.seed if params.sampling else None)
                break
        report = layer_skip_report(state) if first_step or finished is not None else None
        return Generation(state.id, tokens, prefill, top, finished, report,
                          cached_tokens=state.cached_tokens if first_step else None)

    def prefill_tokens(self, state: RequestState, scores: torch.Tensor) -> TokenInfo:
        """Logprob of each prompt token given the ones before it (the first is NaN), from the
        step's scores (`[new]`, the prompt right-aligned, each position scoring the next token)."""
        n = state.input_length
        prompt_ids = state.all_ids[:n]
        values = scores[len(scores) - n:-1].tolist()
        texts = [self.token_text(i) for i in prompt_ids]
        return TokenInfo(prompt_ids, [math.nan, *values], texts, [i in self.special_ids for i in prompt_ids])

    def top_tokens(self, state: RequestState, logits: torch.Tensor) -> TokenInfo:
        ids, values = top_n_tokens(logits.log_softmax(-1), state.top_n_tokens)
        texts = [self.token_text(i) for i in ids]
        return TokenInfo(ids, values, texts, [i in self.special_ids for i in ids])

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))
