"""Grammar-constrained decoding: a request's JSON-schema or regex grammar as a token mask.

Design note. The engine is xgrammar, chosen by measured mask time per token on the default
model (benchmark/grammar_mask.py, figures in docs/benchmarks.md and docs/tuning.md): it
precomputes, per grammar state, which vocabulary entries can follow, so a step's mask is a
bitmask fill plus the cheap apply below, and it rolls back, which verified mode's drafts need.
A grammar is compiled once per (kind, text) for the tokenizer and kept in a small LRU keyed by
its sha256, so the same schema sent by many requests compiles once.

Each request owns a matcher whose state advances with every token the request keeps. The
mask is applied after the penalties and before the warpers (upstream's order). When the
grammar is complete only the end-of-sequence tokens stay allowed, so a constrained request
ends where its grammar ends (or at max_new_tokens). Speculative decoding drafts under the
grammar (each draft advances the matcher) and rolls the matcher back over the drafts before
verification; verification masks each position from the state the accepted tokens reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .grammar_limits import GrammarLimits

COMPILED_CACHE_SIZE = 64  # distinct grammars kept compiled (and refusals kept)
COMPILED_CACHE_BYTES = 256 * 1024 * 1024  # their memory (xgrammar's memory_size_bytes)
# At most this many allowed tokens: copy them into a fresh -inf row instead of masking every entry.
SPARSE_ALLOWED = 2048


class GrammarKind(enum.Enum):
    """The grammar types of the v3 protocol (GrammarType, without NONE)."""

    JSON = "json"  # a JSON schema (a document that matches it)
    REGEX = "regex"  # a regular expression the whole output matches


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar as it arrives: its kind and its text (a schema or a regex)."""

    kind: GrammarKind
    value: str

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind.value}\0{self.value}".encode()).hexdigest()


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary size, with an LRU of results.

    A server compiles with `prepare` (awaited), on one worker thread that is not the thread
    running steps; xgrammar releases the GIL while it compiles, so steps and health checks go on.
    A grammar past `limits` is refused before it compiles; one that does not compile within the
    deadline refuses the requests waiting for it and finishes in the background (kept for a
    retry); one that nobody waits for any more is dropped before it starts. `compile` (in step)
    serves what `prepare` made, and compiles in place only where nothing prepared (tools, tests).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int],
                 limits: GrammarLimits | None = None) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._refused: OrderedDict[str, str] = OrderedDict()  # key -> why the grammar does not compile
        self._pending: dict[str, _Pending] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.compilations = 0  # grammars compiled so far (cache misses)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (cached). Raises ValueError naming what does not compile
        or which limit it passes."""
        found = self._known(spec)
        if found is not None:
            return found
        if spec.key in self._pending:
            raise ValueError(self._late())
        return self._settle(spec.key, lambda: self._compile_text(spec.kind, self._check(spec)))

    async def prepare(self, spec: GrammarSpec) -> None:
        """Compile `spec` off the calling thread, within the deadline; a ValueError refuses it.

        Cancelling the caller (its client went) drops the compile if it has not started and
        nobody else waits for it."""
        if self._known(spec) is not None:
            return
        pending = self._pending.get(spec.key)
        if pending is None:
            if len(self._pending) >= self.limits.max_pending:
                raise ValueError(f"grammar compiler busy: {len(self._pending)} grammars are compiling or "
                                 "waiting to compile; retry later")
            text = self._check(spec)
            loop = asyncio.get_running_loop()
            pending = self._pending[spec.key] = _Pending(self._worker.submit(self._compile_text, spec.kind, text))
            pending.job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finish, spec.key))
        pending.waiters += 1
        try:  # the shield keeps a waiter's timeout or cancellation from cancelling the job
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.job)), self.limits.compile_timeout_s)
        except TimeoutError:
            raise ValueError(self._late()) from None
        except ValueError:
            pass  # the grammar's own refusal, kept by _finish (which ran first) and raised below
        finally:
            pending.waiters -= 1
            if pending.waiters == 0:
                pending.job.cancel()  # only a job that has not started: a running compile finishes
        self._known(spec)

    def _late(self) -> str:
        return (f"grammar is too complex: it did not compile within --grammar-compile-timeout "
                f"({self.limits.compile_timeout_s:g} s)")

    def _known(self, spec: GrammarSpec) -> Any:
        """The cached compiled grammar, None when unknown; raises a grammar's known refusal."""
        if spec.key in self._refused:
            raise ValueError(self._refused[spec.key])
        cached = self._compiled.get(spec.key)
        if cached is not None:
            self._compiled.move_to_end(spec.key)
        return cached

    def _finish(self, key: str) -> None:
        """A background compile ended (a callback on the event loop): keep its result or refusal."""
        job = self._pending.pop(key).job
        if not job.cancelled():
            with contextlib.suppress(ValueError):  # kept in _refused; its waiters raise it
                self._settle(key, job.result)

    def _settle(self, key: str, compiled: Callable[[], Any]) -> Any:
        """Keep what `compiled()` gives: a compiled grammar, or the refusal it raises."""
        try:
            grammar = compiled()
        except ValueError as err:
            self._refused[key] = str(err)
            if len(self._refused) > COMPILED_CACHE_SIZE:
                self._refused.popitem(last=False)
            raise
        self.compilations += 1
        self._compiled[key] = grammar
        while len(self._compiled) > COMPILED_CACHE_SIZE or (
                len(self._compiled) > 1 and self._cached_bytes() > COMPILED_CACHE_BYTES):
            self._compiled.popitem(last=False)
        return grammar

    def _cached_bytes(self) -> int:
        return sum(int(c.memory_size_bytes) for c in self._compiled.values())

    def _check(self, spec: GrammarSpec) -> str:
        """The text to compile, once the grammar is within the limits (a ValueError names the limit)."""
        self.limits.check_text(spec.kind.value, spec.value)
        if spec.kind is GrammarKind.REGEX:
            return spec.value
        schema = _parse_schema(spec.value)
        self.limits.check_schema(schema)
        return json.dumps(schema)

    def _compile_text(self, kind: GrammarKind, text: str) -> Any:
        """Compile a checked grammar text; a ValueError when xgrammar refuses it."""
        try:
            if kind is GrammarKind.JSON:
                # One-line JSON with single spaces after separators, as upstream's outlines regex
                # allows: free whitespace would let a model pad forever inside the grammar.
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            return self._compiler.compile_regex(text)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's errors for an invalid grammar
            reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(err)).strip()  # drop xgrammar's time and source line
            raise ValueError(f"grammar is not valid: {kind.value} grammar does not compile: {reason}") from err

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar."""
        return GrammarMatcher(self._xgr, self.compile(spec), self.vocab_size)


@dataclass
class _Pending:
    """A compile in the worker's queue or running, and how many requests wait for it."""

    job: Future[Any]
    waiters: int = 0


def _parse_schema(value: str) -> Any:
    """The parsed schema; a bad document is the request's error."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"grammar is not valid: the JSON schema is not JSON: {err}") from err
    except RecursionError as err:
        raise ValueError("grammar is too complex: the JSON schema nests too deep to parse") from err


class GrammarMatcher:
    """One request's position in its grammar (see module docstring)."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self.vocab_size = vocab_size

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of tokens the grammar forbids here to -inf, in place; `logits` is `[vocab]`.

        After the grammar terminated nothing is masked (upstream's FSM state -1 does the same).
        """
        if self._matcher.is_terminated():
            return logits
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return apply_bitmask_(logits, self._bitmask[0])

    def accept(self, token_id: int) -> None:
        """Advance over a token chosen under this matcher's mask (nothing once terminated)."""
        if self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            raise AssertionError(f"token {token_id} was chosen under the grammar mask but the grammar refuses it")

    def allows(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (from the current state, in order) the grammar accepts; the state is unchanged."""
        accepted = 0
        for token_id in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Step back over the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar accepted an end-of-sequence token: nothing may follow."""
        return bool(self._matcher.is_terminated())


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set `logits[i]` to -inf where bit i of `bitmask` is 0, in place.

    Args:
        logits: `[vocab]` float32, contiguous, on the CPU.
        bitmask: `[ceil(vocab / 32)]` int32, bit i of word i // 32 (least significant first).

    xgrammar's own `apply_token_bitmask_inplace` costs several times the mask fill on the CPU; here
    the words are unpacked with numpy and, when few tokens are allowed (inside a JSON key, a number,
    an enum), only those are copied into a fresh -inf row.
    """
    vocab = logits.shape[-1]
    words = bitmask.numpy()
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]  # [vocab] 0/1
    values = logits.numpy()
    if int(np.bitwise_count(words.view(np.uint32)).sum()) <= SPARSE_ALLOWED:
        allowed = np.flatnonzero(bits)
        kept = values[allowed]
        values.fill(-np.inf)
        values[allowed] = kept
    else:
        np.putmask(values, bits == 0, -np.inf)
    return logits
