"""Token choice: every token the shard emits or drafts is chosen here.

The interface, by the step that needs it:
- `choose_tokens`: one token per row of a forward's last logits (plain decoding and prefill);
  a batched argmax for the plain-greedy rows, each request's `NextTokenChooser` for the others;
- the speculative package's `draft_token` and `accept` choose drafts and verified tokens
  with the same chooser, so the same processors (watermark, penalties, grammar mask, warpers)
  and the same position-keyed noise of its seed serve every token. `top_n_tokens` gives the
alternatives reported next to a chosen token.
"""

from __future__ import annotations

from .chooser import (
    ChoiceContext,
    NextTokenChooser,
    SamplingParams,
    apply_penalties,
    apply_warpers,
    choose_tokens,
    top_n_tokens,
)

__all__ = ["ChoiceContext", "NextTokenChooser", "SamplingParams", "apply_penalties", "apply_warpers", "choose_tokens",
           "top_n_tokens"]
