"""The router's tokenizer: counts prompt tokens, serves /tokenize and chat templates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
from transformers import AutoTokenizer


@dataclass(frozen=True)
class TokenSpan:
    """One token of /tokenize: id, text and its character span in the input."""

    id: int
    text: str
    start: int
    stop: int


class Tokenizer:
    """A transformers tokenizer loaded from a local folder or hub id."""

    def __init__(self, name: str) -> None:
        self._tok: Any = AutoTokenizer.from_pretrained(name)
        self.chat_template: str | None = getattr(self._tok, "chat_template", None)
        self.bos_token: str | None = self._tok.bos_token
        self.eos_token: str | None = self._tok.eos_token
        self.template_uses_tools = self._uses(self.chat_template, "tools")

    @staticmethod
    def _uses(template: str | None, variable: str) -> bool:
        """Whether the chat template reads `variable` (upstream adds tools to the prompt otherwise)."""
        if not template:
            return False
        try:
            ast = jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError:
            return False  # rendering will report it
        return variable in jinja2.meta.find_undeclared_variables(ast)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included."""
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def spans(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        """Tokens with offsets; slow tokenizers have none and report empty text at 0/0."""
        if not getattr(self._tok, "is_fast", False):
            return [TokenSpan(i, "", 0, 0) for i in self.encode(text, add_special_tokens)]
        enc = self._tok(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [
            TokenSpan(int(i), text[start:stop], int(start), int(stop))
            for i, (start, stop) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        ]

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation with the tokenizer's template, ready for the assistant turn.

        A trailing assistant message is continued, as upstream does (transformers' pipeline
        `continue_final_message`): the prompt ends with that message's text, not a new turn.
        """
        if not self.chat_template:
            raise TemplateError("This model does not have a chat template")
        try:
            text: str = self._tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # jinja2 and transformers raise many kinds; all are user errors
            raise TemplateError(str(err)) from err
        if messages and messages[-1].get("role") == "assistant":
            content = str(messages[-1].get("content") or "")
            index = text.rfind(content)
            if index >= 0:
                text = text[: index + len(content)].rstrip()
        return text


class TemplateError(ValueError):
    """The chat template could not render the request (HTTP 422 template_error)."""
