"""N-gram (prompt-lookup) drafts: free draft tokens copied from the request's own context.

Design note. When a request's output repeats its context (code editing with the code in the
prompt, quoting, summaries that reuse phrases), the tokens that followed an earlier occurrence
of the last few tokens are good guesses for what comes next, and they cost no forward at all.
`lookup` takes the last `n` tokens (n from MAX_NGRAM down to MIN_NGRAM), finds their most
recent earlier occurrence in prompt + generated tokens, and proposes up to `max_tokens` of the
tokens that followed it. Longer n-grams are tried first because they are more specific. These
drafts are verified exactly like layer-skip drafts (one full forward over them), so output
stays lossless; under sampling a copied draft is a point distribution q = 1 at its token, and
rejection sampling accepts it with probability p(d).

Upstream TGI offers the same idea as `--speculate N` (it copies the tokens after the first
occurrence of the last token); here `--speculate N` also turns it on, with N the largest
number of drafts per step, and verified mode uses it before falling back to layer-skip drafts.
"""

from __future__ import annotations

MAX_NGRAM = 3
MIN_NGRAM = 2  # a single-token match is too unspecific: it mostly proposes drafts that get rejected
MAX_SCAN = 4096  # tokens of context searched (bounds the cost on long prompts)


def lookup(token_ids: list[int], max_tokens: int, max_ngram: int = MAX_NGRAM,
           min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the context's last n-gram.

    Args:
        token_ids: the request's tokens so far (prompt then generated).
        max_tokens: the most draft tokens to return (0 returns none).
    Returns:
        The proposed drafts, possibly empty (no match).
    """
    if max_tokens <= 0:
        return []
    context = token_ids[-MAX_SCAN:]
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n:]
        first = suffix[0]
        # Scan right to left for the latest earlier occurrence (the suffix itself excluded).
        for start in range(length - n - 1, -1, -1):
            if context[start] == first and context[start:start + n] == suffix:
                follow = context[start + n:start + n + max_tokens]
                if follow:
                    return follow
    return []
