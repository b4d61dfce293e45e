"""What the batcher sends to a waiting HTTP handler, one event per step (typed, no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True)
class LayerSkipReport:
    """The shard's layer-skip plan for a request (proto LayerSkipReport)."""

    mode: str
    skipped_layers: list[int]
    rule: str
    max_score: float
    mean_score: float
    stats: dict[str, float]


@dataclass(frozen=True)
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: str  # length | eos_token | stop_sequence
    seed: int | None
    cached_tokens: int = 0  # prompt tokens the shard took from its prefix cache


@dataclass(frozen=True)
class PrefillEvent:
    """Prompt tokens with their logprobs (first logprob is NaN), if asked."""

    tokens: list[Token]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; `end` is set on the request's last token."""

    token: Token
    top_tokens: list[Token] = field(default_factory=list)
    end: GeneratedText | None = None
    layer_skip: LayerSkipReport | None = None


@dataclass(frozen=True)
class ErrorEvent:
    """The request ended without its last token.

    `kind` says whose fault it was and so the HTTP answer (errors.error_from_event):
    "validation" (this request's values, refused by the router's encoder or the shard: 422),
    "generation" (the shard failed the whole batch: 424), "shutdown" (the graceful
    termination timeout passed: 503), "incomplete" (the request was lost: 500).
    """

    kind: str
    message: str


InferEvent = PrefillEvent | TokenEvent | ErrorEvent
