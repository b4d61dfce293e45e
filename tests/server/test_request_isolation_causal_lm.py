"""Per-request failure in the shard's `CausalLM`, in-process on the real default model: a request
whose stop check breaks mid-decode ends alone (integration-tests/server/test_request_isolation_shard.py
checks the per-request refusals over gRPC)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.skip_planner import LayerSkipConfig, SkipPlanner
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.models.runner import build_runner
from text_generation_server.models.runner.base import SCORED_ROWS, ForwardInputs
from text_generation_server.pb import generate_pb2
from text_generation_server.sampling import NextTokenChooser, SamplingParams
from text_generation_server.stopping import FinishReason, StoppingCriteria

from factories import decode_in_process, make_batch, make_request

PROMPT = "1, 2, 3, 4, 5,"


class _FailingStop(StoppingCriteria):
    """A stop check that breaks at the request's third token (stands for a detokenization or
    stop-sequence error of this request alone)."""

    def __call__(self, token_id: int, text: str) -> FinishReason | None:
        if self.num_generated == 2:
            raise ValueError("stop sequence check failed")
        return super().__call__(token_id, text)


def test_a_request_failing_mid_decode_ends_alone(model_path: Path) -> None:
    """In-process, on the real model: the failing request gets its error, the other its solo tokens."""
    tokenizer = load_tokenizer(model_path)
    hf_model = load_model(model_path, LoadConfig())
    lm = CausalLM(build_runner(hf_model, "auto"), tokenizer, frozenset({tokenizer.eos_token_id}),
                  SkipPlanner(hf_model, LayerSkipConfig()))

    def decode(requests: list[generate_pb2.Request],
               break_id: int | None) -> tuple[dict[int, list[int]], dict[int, str]]:
        batch = CausalLMBatch.from_pb(make_batch(1, requests), tokenizer, lm.runner.num_layers, lm.eos_token_ids, 1000)
        for state in batch.requests:
            if state.id == break_id:
                s = state.stopping
                state.stopping = _FailingStop(s.max_new_tokens, s.eos_token_ids, s.stop_sequences)
        out = decode_in_process(lm, batch)
        return out.tokens, out.errors

    solo, _ = decode([make_request(1, PROMPT, 8)], None)
    tokens, errors = decode([make_request(1, PROMPT, 8), make_request(2, "Hello", 8)], break_id=2)
    assert errors == {2: "stop sequence check failed"}
    assert len(tokens[2]) == 2  # its tokens before the failure, none after
    assert tokens[1] == solo[1]


# Valid values whose arithmetic overflows: temperature > 0 scales the logits past float32's range.
EXTREME_SAMPLING = [
    {"temperature": 1e-37, "top_p": 0.9},
    {"temperature": 1e-38, "top_p": 0.9},  # overflows at prefill already
    {"temperature": 1e-45, "typical_p": 0.5},
    {"temperature": 1e-30, "top_k": 5, "repetition_penalty": 3.4e38},
]


class _BrokenChooser(NextTokenChooser):
    """A chooser with a bug at the request's third token (not a ValueError: an internal failure)."""

    def __init__(self, params: SamplingParams, prompt_length: int) -> None:
        super().__init__(params)
        self.start = prompt_length

    def __call__(self, logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[int, float]:
        if len(token_ids) >= self.start + 2:
            raise IndexError("index -1 is out of bounds for dimension 0 with size 0")
        return super().__call__(logits, token_ids)


def _lm(model_path: Path) -> CausalLM:
    tokenizer = load_tokenizer(model_path)
    hf_model = load_model(model_path, LoadConfig())
    return CausalLM(build_runner(hf_model, "auto"), tokenizer, frozenset({tokenizer.eos_token_id}),
                    SkipPlanner(hf_model, LayerSkipConfig()))


def test_extreme_sampling_values_are_served_as_their_greedy_limit(model_path: Path) -> None:
    """temperature -> 0 is greedy decoding: each extreme row gets the greedy tokens of its prompt,
    beside a neighbour that keeps its solo tokens."""
    lm = _lm(model_path)
    solo = decode_in_process(lm, _batch(lm, [make_request(1, PROMPT, 8)])).tokens[1]
    greedy_hello = decode_in_process(lm, _batch(lm, [make_request(2, "Hello", 8)])).tokens[2]
    requests = [make_request(1, PROMPT, 8)] + [
        make_request(2 + i, "Hello", 8, do_sample=True, seed=3, **params)  # type: ignore[arg-type]
        for i, params in enumerate(EXTREME_SAMPLING)]
    out = decode_in_process(lm, _batch(lm, requests))
    assert out.errors == {}
    assert out.tokens[1] == solo
    for i, params in enumerate(EXTREME_SAMPLING):
        if "repetition_penalty" not in params:
            assert out.tokens[2 + i] == greedy_hello, params
        assert len(out.tokens[2 + i]) == len(greedy_hello) and all(map(math.isfinite, out.logprobs[2 + i])), params


def test_an_internal_failure_in_token_choice_ends_its_request_alone(model_path: Path) -> None:
    """An exception that is not a request's ValueError: its request gets a plain message (no
    exception text), the neighbour in the same rows its solo tokens."""
    lm = _lm(model_path)
    solo = decode_in_process(lm, _batch(lm, [make_request(1, PROMPT, 8)])).tokens[1]
    batch = _batch(lm, [make_request(1, PROMPT, 8), make_request(2, "Hello", 8, do_sample=True, seed=1)])
    broken = batch.requests[1]
    broken.chooser = _BrokenChooser(broken.chooser.params, broken.input_length)
    out = decode_in_process(lm, batch)
    assert out.tokens[1] == solo
    assert len(out.tokens[2]) == 2
    assert "internal error" in out.errors[2] and "IndexError" not in out.errors[2], out.errors


def _batch(lm: CausalLM, requests: list[generate_pb2.Request]) -> CausalLMBatch:
    return CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers, lm.eos_token_ids, 1000)


def test_prompt_logprobs_are_scored_a_block_of_positions_at_a_time(model_path: Path) -> None:
    """The scored forward runs the head a block of positions at a time (no [rows, prompt, vocab]
    logits), yet gives what one log_softmax over every position's logits gives, and the same last
    logits; the prompt's logprobs are read right-aligned, left padding ignored."""
    lm = _lm(model_path)
    rows, new = 2, SCORED_ROWS + 37  # three blocks of SCORED_ROWS // rows positions
    ids = torch.randint(0, lm.runner.vocab_size, (rows, new), generator=torch.Generator().manual_seed(0))
    targets = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    whole = lm.runner.forward(ForwardInputs.contiguous(ids, last_only=False), lm.runner.new_cache(rows))
    expected = whole.log_softmax(-1).gather(2, targets[:, :, None]).squeeze(2)
    last, scores = lm.runner.forward_scored(ForwardInputs.contiguous(ids), lm.runner.new_cache(rows), targets)
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, whole[:, -1:], atol=1e-4, rtol=0)

    n = new - 3  # the second row's prompt after 3 columns of left padding
    prompt = ids[1, 3:].tolist()
    info = lm.prefill_tokens(SimpleNamespace(input_length=n, all_ids=[*prompt, 7]), scores[1])  # type: ignore[arg-type]
    assert info.ids == prompt and math.isnan(info.logprobs[0]) and len(info.logprobs) == n
    assert info.logprobs[1:] == scores[1, 3:-1].tolist()
