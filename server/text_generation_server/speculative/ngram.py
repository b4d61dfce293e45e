"""N-gram (prompt-lookup) drafts: free draft tokens copied from the request's own context.

Design note. When a request's output repeats its context (code editing with the code in the
prompt, quoting, summaries that reuse phrases), the tokens that followed an earlier occurrence
of the last few tokens are good guesses for what comes next, and they cost no forward at all.
A lookup takes the last `n` tokens (n from MAX_NGRAM down to MIN_NGRAM), finds their most
recent earlier occurrence in prompt + generated tokens, and proposes up to `max_tokens` of the
tokens that followed it. Longer n-grams are tried first because they are more specific. These
drafts are verified exactly like layer-skip drafts (one full forward over them), so output
stays lossless; under sampling a copied draft is kept when the full model's draw is its token,
with probability p(d).

`NgramIndex` keeps, per request, the latest start of every n-gram that has a follower, updated
with the tokens added since its last lookup: a lookup costs O(new tokens), not O(context), so it
can run every step of every row (the watches below need that).

Copies a row does not draft (its batch makes a verification cost more than they would save)
are watched instead (`Watch`): compared with the tokens the row goes on to generate, they give
the same acceptance evidence a drafted cycle would, for nothing; otherwise a request in a batch
could learn its copy acceptance only by paying for a multi-row verification of its first match.

Upstream TGI offers the same idea as `--speculate N` (it copies the tokens after the first
occurrence of the last token); here `--speculate N` also turns it on, with N the largest
number of drafts per step, and verified mode uses it before falling back to layer-skip drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_NGRAM = 3
MIN_NGRAM = 2  # a single-token match is too unspecific: it mostly proposes drafts that get rejected


class NgramIndex:
    """The latest start of each n-gram (MIN_NGRAM..MAX_NGRAM) of a growing token list that has at
    least one token after it. The list may only grow between lookups (a shorter one re-indexes)."""

    def __init__(self) -> None:
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # length of the token list at the last lookup

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the list's last
        n-gram (longest n first); empty when none occurs earlier or max_tokens is 0."""
        self._extend(token_ids)
        length = len(token_ids)
        if max_tokens <= 0:
            return []
        for n in range(min(MAX_NGRAM, length - 1), MIN_NGRAM - 1, -1):
            start = self.latest.get(tuple(token_ids[length - n:]))
            if start is not None:
                return token_ids[start + n:start + n + max_tokens]
        return []

    def _extend(self, token_ids: list[int]) -> None:
        if len(token_ids) < self.indexed:
            self.latest.clear()
            self.indexed = 0
        # The n-grams ending at `end` gain their follower when token end + 1 arrives.
        for end in range(max(self.indexed - 1, 0), len(token_ids) - 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                self.latest[tuple(token_ids[end - n + 1:end + 1])] = end - n + 1
        self.indexed = len(token_ids)


def agreeing(proposed: list[int], generated: list[int]) -> int:
    """How many proposed tokens the generated ones confirm, from the first on."""
    kept = 0
    while kept < min(len(proposed), len(generated)) and proposed[kept] == generated[kept]:
        kept += 1
    return kept


@dataclass(frozen=True)
class Watch:
    """Copies proposed at `start` (the context's length then) and not drafted."""

    start: int
    tokens: list[int]

    def settle(self, token_ids: list[int]) -> tuple[int, int] | None:
        """(drafted, accepted) as a drafted cycle of these copies would have counted them, once the
        tokens generated since `start` decide it (a mismatch, or every copy matched); else None."""
        seen = token_ids[self.start:self.start + len(self.tokens)]
        kept = agreeing(self.tokens, seen)
        if kept < len(seen) or kept == len(self.tokens):
            return len(self.tokens), kept
        return None
