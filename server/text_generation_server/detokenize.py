"""Incremental detokenization for streaming.

A request keeps two offsets into its token ids: `prefix` (start of the window that is
re-decoded for context) and `read` (end of what was already emitted). The new text is the
decode of `[prefix:]` minus the decode of `[prefix:read]`. When that does not grow, or ends
in U+FFFD (an incomplete UTF-8 sequence split across tokens), nothing is emitted and the
offsets stay, so the bytes come out with a later token. Special tokens are shown.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def decode_token(
    tokenizer: PreTrainedTokenizerBase, all_ids: list[int], prefix_offset: int, read_offset: int
) -> tuple[str, int, int]:
    """Text that the last token of `all_ids` adds, and the new (prefix, read) offsets."""
    prefix_text = str(tokenizer.decode(all_ids[prefix_offset:read_offset], skip_special_tokens=False))
    new_text = str(tokenizer.decode(all_ids[prefix_offset:], skip_special_tokens=False))
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        return new_text[len(prefix_text):], read_offset, len(all_ids)
    return "", prefix_offset, read_offset
