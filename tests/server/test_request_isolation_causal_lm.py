"""Per-request failure in the shard's `CausalLM`, in-process on the real default model: a request
whose stop check breaks mid-decode ends alone (integration-tests/server/test_request_isolation_shard.py
checks the per-request refusals over gRPC)."""

from __future__ import annotations

from pathlib import Path

from text_generation_server.models.batch import CausalLMBatch
from text_generation_server.models.causal_lm import CausalLM
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.models.runner import build_runner
from text_generation_server.models.skip_planner import LayerSkipConfig, SkipPlanner
from text_generation_server.pb import generate_pb2
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
