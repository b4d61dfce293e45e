"""Pure parts of the router: SSE framing, batching budget arithmetic, config and launcher flags."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from types import SimpleNamespace
from typing import cast

import pytest
from fastapi import Request

from text_generation_router.config import RouterConfig, ServingLimits
from text_generation_router.engine import memory
from text_generation_router.engine.dispatch import build_warmup_batch
from text_generation_router.engine.errors import Overloaded, ValidationFailed
from text_generation_router.engine.events import GeneratedText, LayerSkipReport, Token
from text_generation_router.engine.infer import FinishedGeneration, Infer, Timing
from text_generation_router.engine.metrics import build_metrics, render
from text_generation_router.engine.queue import Budget, Queue, count_admissible
from text_generation_router.engine.schemas import GenerateParameters
from text_generation_router.engine.tokenizer import Tokenizer
from text_generation_router.engine.validation import Limits, build_valid_request
from text_generation_router.env import LauncherEnv, RouterEnv
from text_generation_router.http import sse
from text_generation_router.http.generate import error_event
from text_generation_router.http.lifecycle import Lifecycle
from text_generation_router.http.openai_shapes import OpenAIError, refuse_unserved
from text_generation_router.http.responses import generate_headers, generate_json
from text_generation_router.http.state import AppState
from text_generation_router.launcher.launcher import child_env, router_argv, shard_argv
from text_generation_router.launcher.launcher_args import parse_args


def test_sse_framing_is_compact_after_one_space() -> None:
    """As axum's writer: `data: ` then compact JSON; huggingface_hub ends a chat stream only at the
    exact line `data: [DONE]`."""
    assert sse.event({"a": 1, "b": [None, "é"]}) == 'data: {"a":1,"b":[null,"é"]}\n\n'.encode()
    assert sse.event({"logprob": math.nan}) == b'data: {"logprob":null}\n\n'
    assert sse.DONE == b"data: [DONE]\n\n"


def test_padded_budget_counts_longest_prompt_times_batch() -> None:
    budget = Budget(prefill_tokens=100, total_tokens=1000, max_size=None)
    # 3 x 30 = 90 prefill tokens fit; a 4th makes 4 x 30 = 120 > 100.
    assert count_admissible([(10, 5), (30, 5), (20, 5), (5, 5)], budget) == 3
    # One long prompt raises every row to its length: 2 x 60 = 120 > 100.
    assert count_admissible([(10, 5), (60, 5)], budget) == 1


def test_padded_budget_total_includes_new_tokens_and_speculate() -> None:
    budget = Budget(prefill_tokens=1000, total_tokens=100, max_size=None, speculate=2)
    # 2 x 20 + (30 + 28) + 2 = 100 fits; a third adds 20 + 1 + 1 more rows.
    assert count_admissible([(20, 30), (20, 28), (20, 1)], budget) == 2


def test_budget_max_size() -> None:
    assert count_admissible([(1, 1)] * 5, Budget(1000, 1000, max_size=2)) == 2


def test_warmup_batch_splits_prefill_tokens() -> None:
    batch = build_warmup_batch(max_input_tokens=300, max_prefill_tokens=512,
                               max_total_tokens=400, max_batch_size=None)
    assert [r.truncate for r in batch.requests] == [300, 212]
    assert [r.stopping_parameters.max_new_tokens for r in batch.requests] == [100, 188]
    assert batch.id == 0 and all(r.id == 0 for r in batch.requests)
    assert batch.size == 2 and batch.max_tokens == 300


def test_configs_reject_bad_limits_with_the_flag_to_change() -> None:
    with pytest.raises(ValueError, match="max-input-tokens"):
        RouterConfig(master_shard_uds_path="/tmp/x-0", tokenizer_name="t", max_input_tokens=10,
                     max_total_tokens=10)
    with pytest.raises(ValueError, match="max_batch_prefill_tokens"):
        ServingLimits(max_input_tokens=1, max_total_tokens=2, max_batch_prefill_tokens=10,
                      max_batch_total_tokens=5)


def test_launcher_argv_follow_upstream_order() -> None:
    args = parse_args(["--model-id", "m", "--shard-uds-path", "/tmp/s", "--max-input-tokens", "8",
                       "--dtype", "bfloat16", "--layer-skip-mode", "shadow", "--layer-skip-policy", "p.json",
                       "--layer-skip-on-bad-policy", "off"])
    argv = shard_argv(args)
    assert argv[1:] == ["serve", "m", "--uds-path", "/tmp/s", "--logger-level", "INFO",
                        "--json-output", "--dtype", "bfloat16", "--otlp-service-name",
                        "text-generation-inference.server", "--max-input-tokens", "8",
                        "--runner", "auto", "--layer-skip-mode", "shadow", "--layer-skip-policy", "p.json",
                        "--layer-skip-on-bad-policy", "off", "--grammar-compile-timeout", "5.0"]
    r = router_argv(args, "/local/folder")
    assert r[r.index("--master-shard-uds-path") + 1] == "/tmp/s-0"
    assert r[r.index("--tokenizer-name") + 1] == "/local/folder"
    assert r[r.index("--waiting-served-ratio") + 1] == "0.3"


def test_launcher_refuses_unsupported_flags_by_name() -> None:
    with pytest.raises(ValueError, match=r"^--speculate 0: use a positive number"):
        parse_args(["--speculate", "0"])
    with pytest.raises(ValueError, match="exactly one shard"):
        parse_args(["--num-shard", "2"])
    args = parse_args([], LauncherEnv.read({"MAX_BEST_OF": "3", "HOSTNAME": "some-container-id"}))
    assert args.ns.max_best_of == 3 and args.ns.hostname == "0.0.0.0"
    assert args.ns.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct" and args.ns.port == 3000


def test_launcher_defaults_come_from_the_environment_it_was_given() -> None:
    env = LauncherEnv.read({"HOSTNAME": "10.0.0.7", "PORT": "", "WATERMARK_GAMMA": "0.25", "JSON_OUTPUT": "yes",
                            "CORS_ALLOW_ORIGIN": "a,b", "HF_API_TOKEN": "t", "LOG_LEVEL": "debug"})
    args = parse_args([], env)
    assert (args.ns.hostname, args.ns.port, args.ns.watermark_gamma) == ("10.0.0.7", 3000, 0.25)
    assert args.ns.json_output and args.ns.cors_allow_origin == ["a", "b"]
    child = child_env(args)
    assert child["HF_TOKEN"] == "t" and child["WATERMARK_GAMMA"] == "0.25"
    assert "LOG_LEVEL" not in child and "PATH" not in child  # the given environment, not os.environ
    with pytest.raises(ValueError, match="^MAX_BEST_OF='many' is not an integer$"):
        parse_args([], LauncherEnv.read({"MAX_BEST_OF": "many"}))


def test_keep_alive_comments_and_cleanup_on_disconnect() -> None:
    cleaned: list[bool] = []

    async def slow() -> AsyncIterator[bytes]:
        try:
            yield b"data:1\n\n"
            await asyncio.sleep(0.35)
            yield b"data:2\n\n"
            await asyncio.sleep(10)
            yield b"data:3\n\n"
        finally:
            cleaned.append(True)

    async def run() -> list[bytes]:
        out: list[bytes] = []
        stream = sse.with_keep_alive(slow(), interval_s=0.1)
        assert isinstance(stream, AsyncGenerator)
        async for item in stream:
            out.append(item)
            if item == b"data:2\n\n":
                break  # the client leaves while the producer waits
        await stream.aclose()
        return out

    out = asyncio.run(run())
    assert out[0] == b"data:1\n\n" and out[-1] == b"data:2\n\n"
    assert sse.KEEP_ALIVE in out[1:-1]
    assert cleaned == [True]


def test_layer_skip_report_in_details_and_headers() -> None:
    skip = LayerSkipReport(mode="shadow", skipped_layers=[3, 7], rule="low-variance", max_score=0.5,
                           mean_score=0.25, stats={"variance": 0.1})
    request = build_valid_request("hi", GenerateParameters(max_new_tokens=1), (8, 1, 1), ("", 0), True)
    g = FinishedGeneration(request=request, generated=GeneratedText("!", 1, "length", None),
                           tokens=[Token(0, "!", -0.5, False)], layer_skip=skip)
    body = generate_json(g, details=True, return_full_text=False, others=[])
    assert body["details"]["layer_skip"] == {
        "mode": "shadow", "skipped_layers": [3, 7], "rule": "low-variance", "max_score": 0.5,
        "mean_score": 0.25, "stats": {"variance": 0.1},
    }
    assert "layer_skip" not in generate_json(g, details=False, return_full_text=False, others=[])
    headers = generate_headers(g, Timing(), 2, RouterEnv().compute_type)
    assert headers["x-layer-skip-mode"] == "shadow" and headers["x-layers-skipped"] == "2"


def test_layer_skip_metrics_follow_the_shard_reports() -> None:
    metrics = build_metrics(100, 200)
    skip = metrics.layer_skip
    lossy = LayerSkipReport(mode="lossy", skipped_layers=[4, 7], rule="calm", max_score=0.1, mean_score=0.05,
                            stats={"decision_ms": 0.2, "shadow_consistency": 0.5, "shadow_checks": 4, "rollbacks": 1})
    skip.observe_plan(lossy)
    assert skip.observe_end(lossy) == 0
    skip.observe_end(lossy)  # the same total again: no second rollback
    verified = LayerSkipReport(mode="verified", skipped_layers=[4], rule="default", max_score=0.0, mean_score=0.0,
                               stats={"drafted": 10, "accepted": 6, "draft_length": 3, "auto_off": 1.0})
    assert skip.observe_end(verified) == 6
    text = render(metrics).decode()
    assert 'tgi_layer_skip_plans{mode="lossy",rule="calm"} 1.0' in text
    assert "tgi_layer_skip_consistency_ratio 0.5" in text
    assert "tgi_layer_skip_rollbacks 1.0" in text and "# TYPE tgi_layer_skip_rollbacks counter" in text
    assert "tgi_layer_skip_accepted_tokens 6.0" in text and "tgi_layer_skip_auto_off 1.0" in text
    assert "tgi_layer_skip_acceptance_ratio_sum 0.6" in text


def _series(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def test_lifecycle_counts_a_stream_once_whatever_its_end() -> None:
    metrics = build_metrics(100, 200)
    infer = Infer(cast(Tokenizer, None), Queue(), cast(Limits, None), metrics, 1, 1)
    state = cast(AppState, SimpleNamespace(infer=infer, metrics=metrics, env=RouterEnv()))

    async def tokens() -> AsyncGenerator[bytes, None]:
        yield b"data:1\n\n"

    async def refused() -> AsyncGenerator[bytes, None]:
        raise ValidationFailed("no")
        yield b""

    async def body(events: Callable[[], AsyncGenerator[bytes, None]]) -> list[bytes]:
        response = Lifecycle.start(state, cast(Request, None)).stream(events, error_event, 1, sse.DONE)
        return [bytes(chunk) async for chunk in response.body_iterator]

    assert asyncio.run(body(tokens)) == [b"data:1\n\n", sse.DONE]
    assert asyncio.run(body(refused)) == [error_event(ValidationFailed("no")), sse.DONE]
    infer.in_flight = 1  # the only slot is taken
    assert asyncio.run(body(tokens)) == [error_event(Overloaded()), sse.DONE]
    text = render(metrics).decode()
    assert _series(text, "tgi_request_count") == 3 and _series(text, "tgi_request_success") == 1
    assert _series(text, 'tgi_request_failure{err="validation"}') == 1
    assert _series(text, 'tgi_request_failure{err="overloaded"}') == 1
    assert _series(text, "tgi_request_duration_count") == 1


def test_memory_is_trimmed_once_after_each_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    """malloc_trim runs when no request is in flight and some were admitted since the last trim:
    not during a request, once after it, not again while idle."""
    trims: list[int] = []
    infer = Infer(cast(Tokenizer, None), Queue(), cast(Limits, None), build_metrics(8, 16), 4, 1)
    monkeypatch.setattr(memory, "_malloc_trim", lambda: lambda: trims.append(infer.admitted))

    async def run() -> None:
        task = asyncio.create_task(memory.trim_after_bursts(infer, interval_s=0.01))
        async with infer.slot(2):
            await asyncio.sleep(0.05)
            assert trims == []  # in flight
        await asyncio.sleep(0.05)
        assert trims == [2]  # once, then idle
        async with infer.slot():
            pass
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(run())
    assert trims == [2, 3]


def test_openai_parameters_are_served_or_refused() -> None:
    """Neutral values pass; any other value of an unserved parameter is refused by name (0 too,
    which compares equal to False)."""
    refuse_unserved(n=1, best_of=None, echo=False, logit_bias={}, functions=[])
    for given in ({"n": 0}, {"n": 2}, {"best_of": 0}, {"echo": True}, {"logit_bias": {"42": 5.0}}):
        with pytest.raises(OpenAIError, match=f"^`{next(iter(given))}` is not supported by this server"):
            refuse_unserved(**given)
