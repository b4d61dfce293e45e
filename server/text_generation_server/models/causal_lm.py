"""CausalLM: one generation step over a cached batch.

`generate_token` reads like the request path: forward -> choose tokens -> stop checks ->
build generations -> advance the batch. Generations are plain dataclasses; the servicer turns
them into protobuf.
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


@dataclass
class StepTimings:
    forward_ns: int
    decode_ns: int


class CausalLM:
    """A loaded model with its tokenizer and runner, able to run batches."""

    def __init__(self, runner: Runner, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                 max_position_embeddings: int = 4096) -> None:
        self.runner = runner
        self.max_position_embeddings = max_position_embeddings
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def generate_token(self, batch: CausalLMBatch) -> tuple[list[Generation], CausalLMBatch | None, StepTimings]:
        """Run one step; returns the generations, the batch to cache (None if all stopped) and timings."""
        start = time.perf_counter_ns()
        needs_prefill_logprobs = not batch.prefilled and any(s.prefill_logprobs for s in batch.requests)
        logits = self.forward(batch, last_only=not needs_prefill_logprobs)  # [rows, 1|new, vocab]
        forward_done = time.perf_counter_ns()
        next_ids, logprobs = self.choose_tokens(batch, logits[:, -1])
        generations = [
            self.request_generation(batch, row, logits, next_ids[row], logprobs[row])
            for row, state in enumerate(batch.requests) if not state.finished
        ]
        batch.advance(next_ids)
        alive = any(not s.finished for s in batch.requests)
        timings = StepTimings(forward_done - start, time.perf_counter_ns() - forward_done)
        return generations, (batch if alive else None), timings

    def forward(self, batch: CausalLMBatch, last_only: bool = True) -> torch.Tensor:
        mask = torch.cat([batch.attention_mask, batch.pending_mask], 1)  # [rows, past + new]
        new = batch.pending_ids.shape[1]
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)[:, -new:]
        return self.runner.forward(batch.pending_ids, position_ids, mask, batch.cache, last_only=last_only)

    def choose_tokens(self, batch: CausalLMBatch, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token per row from `[rows, vocab]` float32 logits."""
        if all(s.chooser.params.is_plain_greedy for s in batch.requests):
            logprobs = logits.log_softmax(-1)
            ids = logprobs.argmax(-1)
            return ids.tolist(), logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
        chosen = [s.chooser(logits[row], torch.tensor(s.all_ids)) for row, s in enumerate(batch.requests)]
        return [c[0] for c in chosen], [c[1] for c in chosen]

    def request_generation(
        self, batch: CausalLMBatch, row: int, logits: torch.Tensor, token_id: int, logprob: float
    ) -> Generation:
        state = batch.requests[row]
        first_step = not state.generated_ids
        prefill = self.prefill_tokens(state, logits[row]) if state.prefill_logprobs and first_step else None
        state.all_ids.append(token_id)
        state.generated_ids.append(token_id)
        text, state.prefix_offset, state.read_offset = decode_token(
            self.tokenizer, state.all_ids, state.prefix_offset, state.read_offset)
        tokens = TokenInfo([token_id], [logprob], [text], [token_id in self.special_ids])
        top = [self.top_tokens(state, logits[row, -1])] if state.top_n_tokens else []
        reason = state.stopping(token_id, text)
        finished = None
        if reason is not None:
            state.finished = True
            params = state.chooser.params
            finished = FinishedText(
                str(self.tokenizer.decode(state.generated_ids, skip_special_tokens=True)),
                len(state.generated_ids), reason, params.seed if params.sampling else None)
        return Generation(state.id, tokens, prefill, top, finished)

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
