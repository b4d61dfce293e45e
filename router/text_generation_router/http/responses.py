"""JSON bodies and headers of the native routes (docs/tgi-interface.md §2.3, §2.4, §2.9)."""

from __future__ import annotations

import time
from typing import Any

from text_generation_router.engine.events import GeneratedText, LayerSkipReport, Token
from text_generation_router.engine.infer import FinishedGeneration, Timing


def token_json(t: Token) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def prefill_json(t: Token) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": t.logprob}


def layer_skip_json(r: LayerSkipReport) -> dict[str, Any]:
    return {
        "mode": r.mode, "skipped_layers": r.skipped_layers, "rule": r.rule,
        "max_score": r.max_score, "mean_score": r.mean_score, "stats": r.stats,
    }


def full_text(g: FinishedGeneration, return_full_text: bool) -> str:
    return g.request.inputs + g.generated.text if return_full_text else g.generated.text


def sequence_details(g: FinishedGeneration) -> dict[str, Any]:
    """The fields shared by `details` and `best_of_sequences` entries."""
    body: dict[str, Any] = {
        "finish_reason": g.generated.finish_reason,
        "generated_tokens": g.generated.generated_tokens,
        "seed": g.generated.seed,
        "prefill": [prefill_json(t) for t in g.prefill],
        "tokens": [token_json(t) for t in g.tokens],
    }
    if g.top_tokens:
        body["top_tokens"] = [[token_json(t) for t in top] for top in g.top_tokens]
    return body


def generate_json(
    g: FinishedGeneration, details: bool, return_full_text: bool, others: list[FinishedGeneration]
) -> dict[str, Any]:
    """GenerateResponse; `others` are the losing best_of sequences."""
    body: dict[str, Any] = {"generated_text": full_text(g, return_full_text)}
    if details:
        d = sequence_details(g)
        if others:
            d["best_of_sequences"] = [
                {"generated_text": full_text(o, return_full_text), **sequence_details(o)}
                for o in others
            ]
        if g.layer_skip is not None:
            d["layer_skip"] = layer_skip_json(g.layer_skip)
        body["details"] = d
    return body


def stream_token_json(
    index: int, token: Token, top: list[Token], end: GeneratedText | None,
    details: bool, prefix: str, input_length: int,
) -> dict[str, Any]:
    """StreamResponse of one token; the last one carries generated_text (and details)."""
    body: dict[str, Any] = {"index": index, "token": token_json(token)}
    if top:
        body["top_tokens"] = [token_json(t) for t in top]
    body["generated_text"] = None if end is None else prefix + end.text
    body["details"] = None
    if end is not None and details:
        body["details"] = {
            "finish_reason": end.finish_reason,
            "generated_tokens": end.generated_tokens,
            "seed": end.seed,
            "input_length": input_length,
        }
    return body


def generate_headers(
    g: FinishedGeneration, timing: Timing, num_characters: int, compute_type: str
) -> dict[str, str]:
    """The x-* headers of a non-streaming answer (times in ms, compute time in s)."""
    now = time.monotonic()
    total_s = now - timing.started
    validation_s = timing.validated - timing.started
    n = max(g.generated.generated_tokens, 1)
    headers = {
        "x-compute-type": compute_type,
        "x-compute-time": f"{total_s}",
        "x-compute-characters": str(num_characters),
        "x-total-time": str(int(total_s * 1000)),
        "x-validation-time": str(int(validation_s * 1000)),
        "x-queue-time": str(int(g.queued_s * 1000)),
        "x-inference-time": str(int(g.inference_s * 1000)),
        "x-time-per-token": str(int(g.inference_s * 1000 / n)),
        "x-prompt-tokens": str(g.request.input_length),
        "x-generated-tokens": str(g.generated.generated_tokens),
    }
    if g.layer_skip is not None:
        headers["x-layer-skip-mode"] = g.layer_skip.mode
        headers["x-layers-skipped"] = str(len(g.layer_skip.skipped_layers))
    return headers


def stream_headers(num_characters: int, compute_type: str) -> dict[str, str]:
    return {
        "x-compute-type": compute_type,
        "x-compute-characters": str(num_characters),
        "X-Accel-Buffering": "no",
        "Cache-Control": "no-cache",
    }
