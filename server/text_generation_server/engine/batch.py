"""CausalLMBatch: the shard-side state of one cached batch.

The requests keep the batch order the router sees (`to_pb`, FilterBatch); their tensor rows
live in plan groups (see plan_groups.py), one left-padded state and KV cache per skip set.
Only this file and the servicer see protobuf types (`from_pb`, `to_pb`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ..grammar import GrammarKind, GrammarSpec
from ..layerskip.plan import MODES, SkipPlan
from ..models.runner.kv_cache import PoolSet
from ..pb import generate_pb2
from ..sampling import ChoiceContext, NextTokenChooser, SamplingParams
from ..speculative.state import SpecState
from ..stopping import StoppingCriteria
from .plan_groups import GroupKey, PlanGroup
from .prefix_cache import PrefixCache

NO_SKIP: GroupKey = frozenset()


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
    layer_skip_mode: str = ""  # the request's override; "" = the server's mode
    plan: SkipPlan | None = None  # decided once, at prefill
    decision_ms: float = 0.0
    spec: SpecState | None = None  # verified mode: acceptance and draft length
    audit_of: int | None = None  # an `off` twin of this lossy request id (never reported)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    chunk_len: int | None = None  # the router's bound on its prompt's first chunk (Request.chunk_len)
    prefix_offset: int = 0
    read_offset: int = 0
    finished: bool = False
    generated_ids: list[int] = field(default_factory=list)


GRAMMAR_KINDS = {generate_pb2.GRAMMAR_TYPE_JSON: GrammarKind.JSON, generate_pb2.GRAMMAR_TYPE_REGEX: GrammarKind.REGEX}


def _params_from_pb(request: generate_pb2.Request) -> SamplingParams:
    p = request.parameters
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


def grammar_from_pb(grammar_type: int, grammar: str) -> GrammarSpec | None:
    """The grammar of a request's parameters (or a PrepareGrammarRequest); None without one."""
    if grammar_type == generate_pb2.GRAMMAR_TYPE_NONE:
        if grammar:
            raise ValueError("a grammar was sent with GRAMMAR_TYPE_NONE")
        return None
    kind = GRAMMAR_KINDS.get(grammar_type)  # type: ignore[call-overload]
    if kind is None:
        raise ValueError(f"grammar_type {grammar_type} is not a GrammarType")
    if not grammar:
        raise ValueError(f"{generate_pb2.GrammarType.Name(grammar_type)} without a grammar")
    return GrammarSpec(kind, grammar)


def _chooser_from_pb(request: generate_pb2.Request, choice: ChoiceContext) -> NextTokenChooser:
    """The request's token chooser; a grammar that does not compile is this request's ValueError."""
    params = _params_from_pb(request)
    watermark = choice.watermark if request.parameters.watermark else None
    grammar = grammar_from_pb(request.parameters.grammar_type, request.parameters.grammar)
    return NextTokenChooser(params, watermark, choice.matcher(grammar))


def _prompt_text(request: generate_pb2.Request) -> str:
    chunks = request.input_chunks.chunks
    if not chunks:
        return request.inputs
    texts = [c.text for c in chunks if c.WhichOneof("chunk") == "text"]
    if len(texts) != len(chunks):
        raise ValueError("image chunks are not supported by this text-only model")
    return "".join(texts)


def _tokenize(request: generate_pb2.Request, tokenizer: PreTrainedTokenizerBase, max_input_tokens: int) -> list[int]:
    text = _prompt_text(request)
    if not text:
        raise ValueError("empty input")
    ids: list[int] = tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"]
    if not ids:
        raise ValueError(f"input {text[:80]!r} encodes to no tokens")
    if request.truncate:  # upstream's shard keeps the last `truncate` tokens, whatever max_input_tokens is
        ids = ids[-request.truncate:]
    elif len(ids) > max_input_tokens:
        raise ValueError(f"{len(ids)} input tokens exceed max_input_tokens={max_input_tokens}")
    return ids


def _request_state(r: generate_pb2.Request, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                   max_input_tokens: int, choice: ChoiceContext) -> RequestState:
    """One request's state; a ValueError names what is wrong with this request."""
    ids = _tokenize(r, tokenizer, max_input_tokens)
    stop = r.stopping_parameters
    if r.layer_skip_mode and r.layer_skip_mode not in MODES:
        raise ValueError(f"layer_skip mode {r.layer_skip_mode!r} is not one of {', '.join(MODES)}")
    return RequestState(
        id=r.id, all_ids=ids, input_length=len(ids),
        chooser=_chooser_from_pb(r, choice),
        stopping=StoppingCriteria(stop.max_new_tokens, eos_token_ids, tuple(stop.stop_sequences),
                                  stop.ignore_eos_token),
        top_n_tokens=r.top_n_tokens, prefill_logprobs=r.prefill_logprobs,
        layer_skip_mode=r.layer_skip_mode, chunk_len=r.chunk_len if r.HasField("chunk_len") else None,
        prefix_offset=max(len(ids) - 5, 0), read_offset=len(ids),
    )


@dataclass
class CausalLMBatch:
    """One cached batch: its requests in batch order, and their rows grouped by skip plan."""

    batch_id: int
    requests: list[RequestState]
    groups: list[PlanGroup]
    num_layers: int
    pad_id: int
    max_tokens: int = 0  # estimated once the rows are grouped (prefill), then after every change

    @classmethod
    def from_pb(
        cls,
        pb: generate_pb2.Batch,
        tokenizer: PreTrainedTokenizerBase,
        num_layers: int,
        eos_token_ids: frozenset[int],
        max_input_tokens: int,
        choice: ChoiceContext | None = None,
    ) -> CausalLMBatch:
        """A new batch, or a ValueError naming the first bad request (upstream's behaviour)."""
        if not pb.requests:
            raise ValueError(f"batch {pb.id} has no requests")
        requests: list[RequestState] = []
        choice = choice or ChoiceContext()
        for r in pb.requests:
            try:
                requests.append(_request_state(r, tokenizer, eos_token_ids, max_input_tokens, choice))
            except ValueError as err:
                raise ValueError(f"request {r.id}: {err}") from err
        return cls._new(pb.id, requests, tokenizer, num_layers)

    @classmethod
    def from_pb_isolated(
        cls,
        pb: generate_pb2.Batch,
        tokenizer: PreTrainedTokenizerBase,
        num_layers: int,
        eos_token_ids: frozenset[int],
        max_input_tokens: int,
        choice: ChoiceContext | None = None,
    ) -> tuple[CausalLMBatch | None, list[tuple[int, str]]]:
        """A new batch of the requests that can run, and (id, message) of those refused alone.

        The batch is None when every request was refused.
        """
        if not pb.requests:
            raise ValueError(f"batch {pb.id} has no requests")
        requests: list[RequestState] = []
        refused: list[tuple[int, str]] = []
        choice = choice or ChoiceContext()
        for r in pb.requests:
            try:
                requests.append(_request_state(r, tokenizer, eos_token_ids, max_input_tokens, choice))
            except ValueError as err:
                refused.append((r.id, str(err)))
        batch = cls._new(pb.id, requests, tokenizer, num_layers) if requests else None
        return batch, refused

    @classmethod
    def _new(cls, batch_id: int, requests: list[RequestState], tokenizer: PreTrainedTokenizerBase,
             num_layers: int) -> CausalLMBatch:
        """A batch without groups: `form_groups` forms them once its requests' plans are known (prefill)."""
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(batch_id, requests, [], num_layers, pad_id)

    def form_groups(self, keys: dict[int, GroupKey], pools: PoolSet, prefixes: PrefixCache | None = None) -> None:
        """Before prefill: one group per distinct key, its KV in that key's pool, rows in batch
        order, each row's cached prompt prefix (from `prefixes`) already in its group's cache. A
        request that asked for its prompt's logprobs runs its whole prompt."""
        assert not self.groups, "groups are formed once, before prefill"
        members: dict[GroupKey, list[RequestState]] = {}
        for state in self.requests:
            members.setdefault(keys[state.id], []).append(state)
        for key, states in members.items():
            prompts = [s.all_ids[: s.input_length] for s in states]
            hits = [prefixes.lookup(key, p) if prefixes is not None and not s.prefill_logprobs else None
                    for s, p in zip(states, prompts, strict=True)]
            for state, hit in zip(states, hits, strict=True):
                state.cached_tokens = hit.length if hit is not None else 0
            self.groups.append(PlanGroup.from_prompts(key, [s.id for s in states], prompts, pools(key),
                                                      self.pad_id, hits))
        self.max_tokens = self._estimate_max_tokens()

    def padded_prompt_tokens(self) -> int:
        """Tokens of the prompts left-padded to the longest, as one group (warmup's measure)."""
        return len(self.requests) * max(s.input_length for s in self.requests)

    def to_pb(self, prefill_chunk: int = 0) -> generate_pb2.CachedBatch:
        """The batch as the router sees it; current_tokens: the tokens its next step runs (a
        decoding row's one, a prefilling group's next chunk of at most `prefill_chunk`)."""
        ids = [s.id for s in self.requests if s.audit_of is None]  # audit twins stay internal
        prefilling = [int(g.pending_mask.sum()) for g in self.groups if g.fresh]
        decoding = sum(g.num_rows for g in self.groups if not g.fresh)
        current = decoding + sum(min(n, prefill_chunk) if prefill_chunk else n for n in prefilling)
        return generate_pb2.CachedBatch(id=self.batch_id, request_ids=ids, size=len(ids),
                                        max_tokens=self.max_tokens, current_tokens=current)

    def filter(self, request_ids: list[int]) -> CausalLMBatch:
        """Keep exactly `request_ids`, in that order; groups left empty are dropped."""
        if not request_ids:
            raise ValueError(f"FilterBatch of batch {self.batch_id} with an empty request list")
        by_id = {s.id: s for s in self.requests if s.audit_of is None}
        missing = [rid for rid in request_ids if rid not in by_id]
        if missing:
            raise ValueError(f"request ids {missing} are not in batch {self.batch_id}")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"FilterBatch of batch {self.batch_id} lists a request twice: {request_ids}")
        kept = set(request_ids)
        twins = [s for s in self.requests if s.audit_of in kept]
        by_id.update((s.id, s) for s in twins)
        self._keep([*request_ids, *(s.id for s in twins)], by_id)
        return self

    def release_kv(self) -> None:
        """Give the KV blocks of every group back to their pools (a batch that has ended)."""
        for group in self.groups:
            group.cache.release()

    def drop(self, request_ids: list[int]) -> None:
        """Remove requests the shard itself retired (settled audit twins)."""
        gone = set(request_ids)
        self._keep([s.id for s in self.requests if s.id not in gone], {s.id: s for s in self.requests})

    def _keep(self, request_ids: list[int], by_id: dict[int, RequestState]) -> None:
        groups = []
        for group in self.groups:
            members = set(group.request_ids)
            kept = [rid for rid in request_ids if rid in members]
            if kept:
                group.filter(kept)
                groups.append(group)
        self.groups = groups
        self.requests = [by_id[rid] for rid in request_ids]
        self.max_tokens = self._estimate_max_tokens()

    def _estimate_max_tokens(self) -> int:
        remaining = sum(s.stopping.max_new_tokens - s.stopping.num_generated for s in self.requests)
        return sum(g.num_rows * g.width for g in self.groups) + remaining

    @classmethod
    def concatenate(cls, batches: list[CausalLMBatch]) -> CausalLMBatch:
        """Stack batches that have run a step, merging groups of the same key; a group still
        prefilling its prompts in chunks stays apart until it has. Keeps the first id."""
        assert all(b.groups for b in batches), "only batches that ran a step can be concatenated"
        by_key: dict[GroupKey, list[PlanGroup]] = {}
        prefilling: list[PlanGroup] = []
        for b in batches:
            for g in b.groups:
                if g.fresh:
                    prefilling.append(g)
                else:
                    by_key.setdefault(g.skip, []).append(g)
        groups = [PlanGroup.concatenate(gs) if len(gs) > 1 else gs[0] for gs in by_key.values()] + prefilling
        first = batches[0]
        out = cls(first.batch_id, [s for b in batches for s in b.requests], groups, first.num_layers, first.pad_id)
        out.max_tokens = out._estimate_max_tokens()
        return out
