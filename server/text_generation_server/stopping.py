"""Stopping criteria, checked after every generated token, in upstream's order:
length (wins even over EOS) -> EOS token (unless ignored) -> stop sequence (literal suffix of
the decoded output, of which only the last 300 characters are kept)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

TAIL_CHARS = 300


class FinishReason(IntEnum):
    """Values equal the proto enum FinishReason."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


@dataclass
class StoppingCriteria:
    """One request's stopping state."""

    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False
    num_generated: int = 0
    tail: str = field(default="")

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be strictly positive, got {self.max_new_tokens}")

    def __call__(self, token_id: int, text: str) -> FinishReason | None:
        """Count one token with its incremental text; the reason to stop, or None."""
        self.num_generated += 1
        if self.num_generated >= self.max_new_tokens:
            return FinishReason.LENGTH
        if not self.ignore_eos_token and token_id in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if self.stop_sequences and text:
            self.tail = (self.tail + text)[-TAIL_CHARS:]
            if any(self.tail.endswith(stop) for stop in self.stop_sequences):
                return FinishReason.STOP_SEQUENCE
        return None
