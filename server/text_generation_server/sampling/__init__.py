"""Token choice: every token the shard emits or drafts is chosen here.

The interface, by the step that needs it:
- `choose_tokens`: one token per row of a forward's last logits (plain decoding and prefill);
  a batched argmax for the plain-greedy rows, each request's `NextTokenChooser` for the others;
- `draft_token`: one draft token of a draft forward (verified mode, --speculate);
- `accept`: the drafts a verification forward keeps, plus the full model's own token.
Every function takes the request's chooser, so the same processors (watermark, penalties,
grammar mask, warpers) and the same position-keyed noise of its seed serve all three. `top_n_tokens` gives the
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
from .speculative import Proposal, accept, copied_drafts, draft_token, target_logits

__all__ = ["ChoiceContext", "NextTokenChooser", "Proposal", "SamplingParams", "accept", "apply_penalties",
           "apply_warpers", "choose_tokens", "copied_drafts", "draft_token", "target_logits", "top_n_tokens"]
