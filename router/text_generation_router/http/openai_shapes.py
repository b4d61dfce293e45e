"""What the OpenAI-compatible routes share: parameter mapping and response envelopes
(docs/tgi-interface.md §2.5-2.6)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from text_generation_router import __version__
from text_generation_router.engine.errors import InferError
from text_generation_router.engine.infer import FinishedGeneration
from text_generation_router.http import sse
from text_generation_router.http.state import AppState

FINGERPRINT = f"{__version__}-native"
# OpenAI's finish reasons (stop, length, tool_calls, content_filter): a stop sequence is `stop`
# there, where TGI's own routes say `stop_sequence`; a tool answer ends with `tool_calls`.
OPENAI_FINISH = {"eos_token": "stop", "length": "length", "stop_sequence": "stop"}
TOOL_CALLS = "tool_calls"


class OpenAIError(InferError):
    status = 422

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.metric_label = "validation"


def sampling(temperature: float | None) -> tuple[bool, float | None]:
    """Temperature 0 means greedy; anything else, absent included, samples (§8.6)."""
    if temperature == 0:
        return False, None
    return True, temperature


def presence_as_repetition(presence_penalty: float | None, repetition_penalty: float | None = None) -> float | None:
    """Upstream serves OpenAI's presence_penalty as its repetition_penalty, shifted by 2."""
    return repetition_penalty if presence_penalty is None else presence_penalty + 2.0


def refuse_unserved(**values: Any) -> None:
    """A 422 naming the first OpenAI parameter given a value this server does not serve (`n` or
    `best_of` above 1, `echo`, a non-empty `logit_bias`, the deprecated `functions`): a
    parameter is served or refused, never dropped."""
    for name, value in values.items():
        if value is None or value is False or value in ({}, []) or (name in ("n", "best_of") and value == 1):
            continue
        raise OpenAIError("validation", f"`{name}` is not supported by this server (given: "
                                        f"{json.dumps(value)[:80]}); see the README's OpenAI section")


def stops(stop: list[str] | str | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def adapter(model: str | None, state: AppState) -> str | None:
    if model in (None, "", "tgi", state.model_id, state.config.tokenizer_name):
        return None
    return model


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, object]:
    """OpenAI's usage object; `cached`: prompt tokens the shard took from its prefix cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    """A unique id in OpenAI's shape: `chatcmpl-...`, `cmpl-...`, `call_...` (upstream sends "" and
    "0", so a conversation with two tool calls cannot tell which result answers which)."""
    return prefix + secrets.token_hex(12)


def error_event(err: InferError) -> bytes:
    """The OpenAI streams' error event, before their [DONE]; upstream writes 422 whatever the error."""
    return sse.event({"error": {"message": err.message, "http_status_code": 422}})


def logprobs_json(g: FinishedGeneration) -> dict[str, Any]:
    content = []
    for n, t in enumerate(g.tokens):
        top = g.top_tokens[n] if n < len(g.top_tokens) else []
        content.append({"token": t.text, "logprob": t.logprob,
                        "top_logprobs": [{"token": x.text, "logprob": x.logprob} for x in top]})
    return {"content": content}
