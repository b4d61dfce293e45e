"""CausalLMBatch: the shard-side state of one cached batch (left-padded, dense KV cache).

Tensor layout, for `rows` requests:
- `cache`: the KV cache, `cache.length` columns, each row's tokens right-aligned;
- `attention_mask`: `[rows, cache.length]`, 1 for a real token, 0 for left padding;
- `pending_ids` / `pending_mask`: `[rows, new]` the tokens to run next (the prompts at
  prefill, the last chosen token after), with their mask (padding only at prefill).

Only this file and the servicer see protobuf types (`from_pb`, `to_pb`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from ..pb import generate_pb2
from ..sampling import NextTokenChooser, SamplingParams
from ..stopping import StoppingCriteria
from .runner.base import Runner
from .runner.kv_cache import KVCache


@dataclass
class RequestState:
    """Everything the shard tracks for one request of a batch."""

    id: int
    all_ids: list[int]  # prompt then generated tokens
    input_length: int
    chooser: NextTokenChooser
    stopping: StoppingCriteria
    top_n_tokens: int = 0
    prefill_logprobs: bool = False
    layer_skip_mode: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    finished: bool = False
    generated_ids: list[int] = field(default_factory=list)


def _params_from_pb(request: generate_pb2.Request) -> SamplingParams:
    p = request.parameters
    if p.watermark:
        raise ValueError(f"request {request.id}: watermark is not supported by this shard")
    if p.grammar_type != generate_pb2.GRAMMAR_TYPE_NONE or p.grammar:
        raise ValueError(f"request {request.id}: grammar ({generate_pb2.GrammarType.Name(p.grammar_type)}) "
                         f"is not supported by this shard")
    return SamplingParams(
        temperature=p.temperature if p.temperature else 1.0,
        top_k=p.top_k,
        top_p=p.top_p if p.top_p else 1.0,
        typical_p=p.typical_p if p.typical_p else 1.0,
        do_sample=p.do_sample,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty else 1.0,
        frequency_penalty=p.frequency_penalty,
    )


def _prompt_text(request: generate_pb2.Request) -> str:
    chunks = request.input_chunks.chunks
    if not chunks:
        return request.inputs
    texts = [c.text for c in chunks if c.WhichOneof("chunk") == "text"]
    if len(texts) != len(chunks):
        raise ValueError(f"request {request.id}: image chunks are not supported by this text-only model")
    return "".join(texts)


def _tokenize(request: generate_pb2.Request, tokenizer: PreTrainedTokenizerBase, max_input_tokens: int) -> list[int]:
    text = _prompt_text(request)
    if not text:
        raise ValueError(f"request {request.id}: empty input")
    ids: list[int] = tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"]
    if not ids:
        raise ValueError(f"request {request.id}: input {text!r} encodes to no tokens")
    if request.truncate:
        if request.truncate > max_input_tokens:
            raise ValueError(f"request {request.id}: truncate={request.truncate} is out of range "
                             f"(max_input_tokens={max_input_tokens})")
        ids = ids[-request.truncate:]
    if len(ids) > max_input_tokens:
        raise ValueError(f"request {request.id}: {len(ids)} input tokens exceed max_input_tokens={max_input_tokens}")
    return ids


@dataclass
class CausalLMBatch:
    """One cached batch (see module docstring)."""

    batch_id: int
    requests: list[RequestState]
    cache: KVCache
    attention_mask: torch.Tensor  # [rows, cache.length]
    pending_ids: torch.Tensor  # [rows, new]
    pending_mask: torch.Tensor  # [rows, new]
    max_tokens: int

    @classmethod
    def from_pb(
        cls,
        pb: generate_pb2.Batch,
        tokenizer: PreTrainedTokenizerBase,
        runner: Runner,
        eos_token_ids: frozenset[int],
        max_input_tokens: int,
    ) -> CausalLMBatch:
        if not pb.requests:
            raise ValueError(f"batch {pb.id} has no requests")
        requests: list[RequestState] = []
        for r in pb.requests:
            ids = _tokenize(r, tokenizer, max_input_tokens)
            stop = r.stopping_parameters
            requests.append(RequestState(
                id=r.id, all_ids=ids, input_length=len(ids),
                chooser=NextTokenChooser(_params_from_pb(r)),
                stopping=StoppingCriteria(stop.max_new_tokens, eos_token_ids, tuple(stop.stop_sequences),
                                          stop.ignore_eos_token),
                top_n_tokens=r.top_n_tokens, prefill_logprobs=r.prefill_logprobs,
                layer_skip_mode=r.layer_skip_mode,
                prefix_offset=max(len(ids) - 5, 0), read_offset=len(ids),
            ))
        width = max(s.input_length for s in requests)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        pending_ids = torch.full((len(requests), width), pad, dtype=torch.long)
        pending_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, s in enumerate(requests):
            pending_ids[row, width - s.input_length:] = torch.tensor(s.all_ids)
            pending_mask[row, width - s.input_length:] = 1
        max_new = sum(s.stopping.max_new_tokens for s in requests)
        return cls(
            batch_id=pb.id, requests=requests, cache=runner.new_cache(len(requests)),
            attention_mask=torch.zeros((len(requests), 0), dtype=torch.long),
            pending_ids=pending_ids, pending_mask=pending_mask,
            max_tokens=len(requests) * width + max_new,
        )

    def to_pb(self) -> generate_pb2.CachedBatch:
        return generate_pb2.CachedBatch(
            id=self.batch_id, request_ids=[s.id for s in self.requests], size=len(self.requests),
            max_tokens=self.max_tokens, current_tokens=len(self.requests),
        )

    @property
    def prefilled(self) -> bool:
        return self.cache.length > 0

    def filter(self, request_ids: list[int]) -> CausalLMBatch:
        """Keep exactly `request_ids`, in that order; trims columns that became all padding."""
        if not request_ids:
            raise ValueError(f"FilterBatch of batch {self.batch_id} with an empty request list")
        position = {s.id: row for row, s in enumerate(self.requests)}
        missing = [rid for rid in request_ids if rid not in position]
        if missing:
            raise ValueError(f"request ids {missing} are not in batch {self.batch_id}")
        rows = [position[rid] for rid in request_ids]
        if rows == list(range(len(self.requests))):
            return self
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.attention_mask.index_select(0, index)
        new_length = int(mask.sum(1).max()) if self.prefilled else 0
        self.cache.filter(rows, new_length)
        self.attention_mask = mask[:, mask.shape[1] - new_length:]
        self.pending_ids = self.pending_ids.index_select(0, index)
        self.pending_mask = self.pending_mask.index_select(0, index)
        self.requests = [self.requests[row] for row in rows]
        self.max_tokens = self._estimate_max_tokens()
        return self

    def _estimate_max_tokens(self) -> int:
        remaining = sum(s.stopping.max_new_tokens - s.stopping.num_generated for s in self.requests)
        return len(self.requests) * self.attention_mask.shape[1] + remaining

    @classmethod
    def concatenate(cls, batches: list[CausalLMBatch]) -> CausalLMBatch:
        """Stack prefilled batches (left-padding to the longest); keeps the first batch's id."""
        assert all(b.prefilled for b in batches), "only prefilled batches can be concatenated"
        length = max(b.cache.length for b in batches)
        masks = [torch.nn.functional.pad(b.attention_mask, (length - b.cache.length, 0)) for b in batches]
        out = cls(
            batch_id=batches[0].batch_id,
            requests=[s for b in batches for s in b.requests],
            cache=KVCache.concatenate([b.cache for b in batches]),
            attention_mask=torch.cat(masks, 0),
            pending_ids=torch.cat([b.pending_ids for b in batches], 0),
            pending_mask=torch.cat([b.pending_mask for b in batches], 0),
            max_tokens=0,
        )
        out.max_tokens = out._estimate_max_tokens()
        return out

    def advance(self, next_ids: list[int]) -> None:
        """After a forward: the pending tokens are in the cache; the chosen ones are next."""
        self.attention_mask = torch.cat([self.attention_mask, self.pending_mask], 1)
        self.pending_ids = torch.tensor(next_ids, dtype=torch.long).unsqueeze(1)
        self.pending_mask = torch.ones((len(next_ids), 1), dtype=torch.long)
