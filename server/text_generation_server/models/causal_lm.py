"""CausalLM: one generation step over a cached batch.

`generate_token` reads like the request path: plan (new requests) -> forward (one per plan
group) -> choose tokens -> stop checks and generations -> advance the batch. Generations
are plain dataclasses; the servicer turns them into protobuf.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from ..detokenize import decode_token
from ..sampling import top_n_tokens
from ..stopping import FinishReason
from .batch import CausalLMBatch, RequestState
from .runner.base import Runner
from .skip_planner import SkipPlanner


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
    layer_skip: SkipReport | None = None


@dataclass
class SkipReport:
    """A request's plan as reported on its first generation (when its mode is not off)."""

    mode: str
    skipped_layers: list[int]
    rule: str
    scores: dict[str, float]
    decision_ms: float


def skip_report(state: RequestState) -> SkipReport | None:
    plan = state.plan
    if plan is None or plan.mode == "off":
        return None
    return SkipReport(plan.mode, sorted(plan.skipped), plan.rule, dict(plan.scores), state.decision_ms)


@dataclass
class StepTimings:
    forward_ns: int
    decode_ns: int


Choice = tuple[int, float]  # (token id, logprob)


class CausalLM:
    """A loaded model with its tokenizer, runner and skip planner, able to run batches."""

    def __init__(self, runner: Runner, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                 planner: SkipPlanner, max_position_embeddings: int = 4096) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.planner = planner
        self.max_position_embeddings = max_position_embeddings
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def generate_token(self, batch: CausalLMBatch) -> tuple[list[Generation], CausalLMBatch | None, StepTimings]:
        """Run one step; returns the generations, the batch to cache (None if all stopped) and timings."""
        start = time.perf_counter_ns()
        if not batch.prefilled:
            self.plan(batch)
        logits = self.forward(batch)  # request id -> [1 | new, vocab]
        forward_done = time.perf_counter_ns()
        chosen = self.choose_tokens(batch, logits)
        generations = [self.request_generation(state, logits[state.id], *chosen[state.id])
                       for state in batch.requests if not state.finished]
        for group in batch.groups:
            group.advance([chosen[rid][0] for rid in group.request_ids])
        alive = any(not s.finished for s in batch.requests)
        timings = StepTimings(forward_done - start, time.perf_counter_ns() - forward_done)
        return generations, (batch if alive else None), timings

    def plan(self, batch: CausalLMBatch) -> None:
        """Decide each request's SkipPlan and group the batch's rows by the layers they skip."""
        for state in batch.requests:
            state.plan = self.planner.plan(state)
            state.plan.check_layers(self.runner.num_layers)
        batch.regroup({s.id: s.plan.applied if s.plan else frozenset() for s in batch.requests})

    def forward(self, batch: CausalLMBatch) -> dict[int, torch.Tensor]:
        """One forward per plan group, each bypassing its group's layers."""
        logits: dict[int, torch.Tensor] = {}
        states = {s.id: s for s in batch.requests}
        for group in batch.groups:
            prefill = group.cache.length == 0
            all_positions = prefill and any(states[rid].prefill_logprobs for rid in group.request_ids)
            input_ids, position_ids, mask = group.forward_inputs()
            out = self.runner.forward(input_ids, position_ids, mask, group.cache, last_only=not all_positions,
                                      skip_layers=group.skip)  # [rows, 1 | new, vocab]
            logits.update(zip(group.request_ids, out, strict=True))
        return logits

    def choose_tokens(self, batch: CausalLMBatch, logits: dict[int, torch.Tensor]) -> dict[int, Choice]:
        """One token per request from the logits of its last position."""
        choices: dict[int, Choice] = {}
        by_id = {s.id: s for s in batch.requests}
        for group in batch.groups:
            states = [by_id[rid] for rid in group.request_ids]
            if all(s.chooser.params.is_plain_greedy for s in states):
                last = torch.stack([logits[rid][-1] for rid in group.request_ids])  # [rows, vocab]
                logprobs = last.log_softmax(-1)
                ids = logprobs.argmax(-1)
                values = logprobs.gather(1, ids[:, None]).squeeze(1)
                choices.update(zip(group.request_ids, zip(ids.tolist(), values.tolist(), strict=True), strict=True))
                continue
            for s in states:
                choices[s.id] = s.chooser(logits[s.id][-1], torch.tensor(s.all_ids))
        return choices

    def request_generation(self, state: RequestState, logits: torch.Tensor, token_id: int,
                           logprob: float) -> Generation:
        """Record the chosen token, detokenize it, check stopping. `logits`: [1 | new, vocab]."""
        first_step = not state.generated_ids
        prefill = self.prefill_tokens(state, logits) if state.prefill_logprobs and first_step else None
        report = skip_report(state) if first_step else None
        state.all_ids.append(token_id)
        state.generated_ids.append(token_id)
        text, state.prefix_offset, state.read_offset = decode_token(
            self.tokenizer, state.all_ids, state.prefix_offset, state.read_offset)
        tokens = TokenInfo([token_id], [logprob], [text], [token_id in self.special_ids])
        top = [self.top_tokens(state, logits[-1])] if state.top_n_tokens else []
        reason = state.stopping(token_id, text)
        finished = None
        if reason is not None:
            state.finished = True
            params = state.chooser.params
            finished = FinishedText(
                str(self.tokenizer.decode(state.generated_ids, skip_special_tokens=True)),
                len(state.generated_ids), reason, params.seed if params.sampling else None)
        return Generation(state.id, tokens, prefill, top, finished, report)

    def prefill_tokens(self, state: RequestState, logits: torch.Tensor) -> TokenInfo:
        """Logprob of each prompt token given the ones before it (the first is NaN)."""
        n = state.input_length
        prompt_ids = state.all_ids[:n]
        row_logprobs = logits[-n:].log_softmax(-1)  # [n, vocab], right-aligned real positions
        targets = torch.tensor(prompt_ids[1:], dtype=torch.long)
        values = row_logprobs[:-1].gather(1, targets[:, None]).squeeze(1).tolist() if n > 1 else []
        texts = [self.token_text(i) for i in prompt_ids]
        return TokenInfo(prompt_ids, [math.nan, *values], texts, [i in self.special_ids for i in prompt_ids])

    def top_tokens(self, state: RequestState, logits: torch.Tensor) -> TokenInfo:
        ids, values = top_n_tokens(logits.log_softmax(-1), state.top_n_tokens)
        texts = [self.token_text(i) for i in ids]
        return TokenInfo(ids, values, texts, [i in self.special_ids for i in ids])

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))
