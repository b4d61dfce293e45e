"""Grammar-constrained decoding: a request's JSON-schema or regex grammar as a token mask.

Design note. The engine is xgrammar, chosen by measured mask time per token on the default
model (benchmark/grammar_mask.py, figures in the README): it precomputes, per grammar state,
which vocabulary entries can follow, so a step's mask is a bitmask fill (~0.2 ms on the
default model's 49152-token vocabulary, one thread) plus the cheap apply below, and it rolls
back, which verified mode's drafts need. A grammar is compiled once per (kind, text) for the tokenizer and kept in a
small LRU keyed by its sha256, so the same schema sent by many requests compiles once.

Each request owns a matcher whose state advances with every token the request keeps. The
mask is applied after the penalties and before the warpers (upstream's order). When the
grammar is complete only the end-of-sequence tokens stay allowed, so a constrained request
ends where its grammar ends (or at max_new_tokens). Speculative decoding drafts under the
grammar (each draft advances the matcher) and rolls the matcher back over the drafts before
verification; verification masks each position from the state the accepted tokens reach.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

COMPILED_CACHE_SIZE = 64  # distinct grammars kept compiled
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
    """Compiles grammars for one tokenizer and vocabulary size, with an LRU of results."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.compilations = 0  # grammars compiled so far (cache misses)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (cached). Raises ValueError naming what does not compile."""
        cached = self._compiled.get(spec.key)
        if cached is not None:
            self._compiled.move_to_end(spec.key)
            return cached
        schema = _schema_text(spec.value) if spec.kind is GrammarKind.JSON else ""
        try:
            if spec.kind is GrammarKind.JSON:
                # One-line JSON with single spaces after separators, as upstream's outlines regex
                # allows: free whitespace would let a model pad forever inside the grammar.
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
            else:
                compiled = self._compiler.compile_regex(spec.value)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's errors for an invalid grammar
            reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(err)).strip()  # drop xgrammar's time and source line
            raise ValueError(f"grammar is not valid: {spec.kind.value} grammar does not compile: {reason}") from err
        self.compilations += 1
        self._compiled[spec.key] = compiled
        if len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar."""
        return GrammarMatcher(self._xgr, self.compile(spec), self.vocab_size)


def _schema_text(value: str) -> str:
    """The schema as JSON text; a bad document is the request's error."""
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"grammar is not valid: the JSON schema is not JSON: {err}") from err
    return json.dumps(schema)


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

    xgrammar's own `apply_token_bitmask_inplace` costs ~10x the mask fill on the CPU; here the
    words are unpacked with numpy and, when few tokens are allowed (inside a JSON key, a number,
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
