"""One step of one plan group: a plain forward (off, shadow, lossy, and every prefill), or a
draft-verify cycle (speculating decode: verified mode or --speculate, see speculative/state.py).

A step runs in two phases, so that CausalLM times them apart: `forward` runs the model (and,
in a cycle, chooses the drafts between draft forwards, timed as choice), `choose` picks the
tokens from the logits (sampling/) and leaves the group ready for the next step; it returns,
per request, the tokens it chose this step and the logits they came from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.runner.base import ForwardInputs, Runner
from ..sampling import choose_tokens
from ..sampling.chooser import FAILED_CHOICE, failure_message
from ..speculative.accept import Proposal, accept, copied_drafts, draft_token
from ..speculative.controller import CyclePlan
from ..speculative.draft_head import DraftHead
from .batch import RequestState
from .plan_groups import PlanGroup
from .step_timing import Stage, StageClock


@dataclass
class RowStep:
    """What one request got from one step.

    Attributes:
        token_ids / logprobs: the chosen tokens, in order (several in verified mode).
        logits: `[len(token_ids), vocab]` the (full-model) logits each token was chosen from.
        prompt_logprobs: `[new]` at prefill, when prompt logprobs were asked for: each position's
            log-probability of the next prompt token (the row's prompt is right-aligned).
        drafted / accepted: draft tokens proposed and kept (verified mode).
        source: the drafter of this step's drafts ("model" or "ngram").
        error: the request failed alone in this step (its message); its token is a placeholder.
    """

    token_ids: list[int]
    logprobs: list[float]
    logits: torch.Tensor
    prompt_logprobs: torch.Tensor | None = None
    drafted: int = 0
    accepted: int = 0
    source: str = "model"
    error: str | None = None


Biases = Mapping[int, torch.Tensor]  # graceful bypass: layer index -> mean residual update [hidden]


class GroupStep(Protocol):
    """One group's step: `forward` once, then `choose` once."""

    def forward(self, clock: StageClock) -> None: ...

    def choose(self) -> dict[int, RowStep]: ...


class PlainStep:
    """One forward of the group with its skip set, one token per row."""

    def __init__(self, runner: Runner, group: PlanGroup, states: list[RequestState], biases: Biases) -> None:
        self.runner, self.group, self.states, self.biases = runner, group, states, biases
        self.prefill = group.fresh
        self.logits: torch.Tensor | None = None  # [rows, 1, vocab] after `forward`
        self.scores: torch.Tensor | None = None  # [rows, new]: prompt logprobs, where asked for

    def forward(self, clock: StageClock) -> None:
        inputs = ForwardInputs(*self.group.forward_inputs())
        model = self.runner.bypassing(self.group.skip, self.biases)
        if self.prefill and any(s.prefill_logprobs for s in self.states):
            ids = inputs.input_ids  # each position scores the next column (the last one: a placeholder)
            self.logits, scores = model.forward_scored(inputs, self.group.cache,
                                                       torch.cat([ids[:, 1:], ids[:, -1:]], dim=1))
            self.scores = self.group.add_prompt_scores(scores)  # after the earlier chunks' (advance drops them)
        else:
            self.logits = model.forward(inputs, self.group.cache)

    def choose(self) -> dict[int, RowStep]:
        logits = self.logits
        assert logits is not None, "choose runs after forward"
        last = logits[:, -1]  # [rows, vocab]
        states = self.states
        choices, failures = choose_tokens(last, [s.chooser for s in states], [s.all_ids for s in states])
        self.group.advance([token for token, _ in choices])
        return {
            s.id: RowStep([token], [logprob], last[row : row + 1],
                          self.scores[row] if self.scores is not None and s.prefill_logprobs else None,
                          error=failures.get(row))
            for row, (s, (token, logprob)) in enumerate(zip(states, choices, strict=True))
        }


class ChunkStep:
    """A chunk of a long prefill: the group's next `width` prompt columns run and no token is
    chosen (the prompts' last columns run as a PlainStep, which chooses the first tokens). Where
    a row asks for its prompt's logprobs, each position scores the next prompt column (the
    chunk's last, the next chunk's first) and the group keeps them for that PlainStep."""

    def __init__(self, runner: Runner, group: PlanGroup, width: int, biases: Biases, scored: bool = False) -> None:
        self.runner, self.group, self.width, self.biases, self.scored = runner, group, width, biases, scored

    def forward(self, clock: StageClock) -> None:
        group = self.group
        inputs = ForwardInputs(*group.forward_inputs(self.width))
        model = self.runner.bypassing(group.skip, self.biases)
        if self.scored:
            _, scores = model.forward_scored(inputs, group.cache, group.pending_ids[:, 1:self.width + 1])
            group.add_prompt_scores(scores)
        else:
            model.forward(inputs, group.cache)
        group.advance_chunk(self.width)

    def choose(self) -> dict[int, RowStep]:
        return {}


class VerifiedStep:
    """A draft-verify cycle of a prefilled group: copied drafts where the plan has them, model
    drafts (`cycle.model_k` forwards with the cycle's draft layers bypassed and `head`) for the
    other drafting rows, then one full forward over every row's drafts (see speculative/state.py)."""

    def __init__(self, runner: Runner, group: PlanGroup, states: list[RequestState], cycle: CyclePlan,
                 biases: Biases, head: DraftHead | None = None) -> None:
        self.runner, self.group, self.states, self.cycle = runner, group, states, cycle
        self.biases, self.head = biases, head
        self.proposals = [copied_drafts(r.copies) if r.copies else Proposal() for r in cycle.rows]
        self.failures: dict[int, str] = {}  # row -> its request's message: it drafts no more, accepts nothing
        self.logits: torch.Tensor | None = None  # [rows, width + 1, vocab] after `forward`

    def forward(self, clock: StageClock) -> None:
        if self.cycle.model_k:
            self._model_drafts(clock)
            self.group.discard_drafts()  # no draft hidden state stays in the cache
        inputs = ForwardInputs(*self.group.verify_inputs([p.token_ids for p in self.proposals]), last_only=False)
        self.logits = self.runner.forward(inputs, self.group.cache)

    def choose(self) -> dict[int, RowStep]:
        logits = self.logits
        assert logits is not None, "choose runs after forward"
        steps: dict[int, RowStep] = {}
        for row, (s, p) in enumerate(zip(self.states, self.proposals, strict=True)):
            drafted = len(p.token_ids)
            tokens, logprobs, kept = self._accept(row, s, p, logits[row, : drafted + 1])
            steps[s.id] = RowStep(tokens, logprobs, logits[row, : len(tokens)], drafted=drafted, accepted=kept,
                                  source=p.source, error=self.failures.get(row))
        rows = [steps[s.id] for s in self.states]
        self.group.accept_drafts([r.accepted for r in rows], [r.token_ids[-1] for r in rows])
        return steps

    def _model_drafts(self, clock: StageClock) -> None:
        """`cycle.model_k` draft forwards over the whole group; rows with copied drafts feed them
        (their outputs are ignored), the model rows get the draft model's tokens."""
        group, cycle, head = self.group, self.cycle, self.head
        ids, _, mask = group.forward_inputs()
        model = self.runner.draft_model(cycle.skip, head.weight if head is not None else None, self.biases)
        for j in range(cycle.model_k):
            positions = (mask.cumsum(1) - 1)[:, -1:]
            logits = model.forward(ForwardInputs(ids, positions, mask), group.cache)[:, -1]
            with clock.stage(Stage.CHOOSE):
                fed = []
                for row, (s, p) in enumerate(zip(self.states, self.proposals, strict=True)):
                    if cycle.rows[row].model and row not in self.failures:
                        fed.append(self._draft(row, s, p, logits[row], head))
                    else:  # a copied or a non-drafting row: keep its tensors in step, its output is unused
                        fed.append(p.token_ids[j] if j < len(p.token_ids) else int(ids[row, -1]))
            ids = torch.tensor(fed, dtype=torch.long)[:, None]
            mask = torch.cat([mask, torch.ones((group.num_rows, 1), dtype=torch.long)], 1)

    def _accept(self, row: int, state: RequestState, proposal: Proposal,
                logits: torch.Tensor) -> tuple[list[int], list[float], int]:
        """`accept` of one row; a row that failed (now or drafting) keeps a placeholder and no draft."""
        if row not in self.failures:
            try:
                return accept(state.chooser.params, logits, state.all_ids, proposal, state.chooser)
            except Exception as err:  # noqa: BLE001 - one request's failure must not fail the batch
                self.failures[row] = failure_message(err)
        return [FAILED_CHOICE[0]], [FAILED_CHOICE[1]], 0

    def _draft(self, row: int, state: RequestState, proposal: Proposal, logits: torch.Tensor,
               head: DraftHead | None) -> int:
        """One model draft of `row`; a failure is its request's alone (a placeholder is fed)."""
        try:
            return draft_token(state.chooser.params, logits, state.all_ids + proposal.token_ids, proposal, head,
                               self.runner.vocab_size, state.chooser)
        except Exception as err:  # noqa: BLE001 - one request's failure must not fail the batch
            self.failures[row] = failure_message(err)
            return FAILED_CHOICE[0]
