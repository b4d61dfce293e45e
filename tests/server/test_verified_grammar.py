"""Verified mode under a grammar (and a watermark) on the real default model: greedy output
equals `off`'s with the same grammar, token for token, while drafts are really proposed and
accepted under the grammar (drafting forced on, 6 of 30 layers bypassed in drafts, float32).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from test_layer_skip_shard import make_lm

from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.models.loading import LoadConfig, load_model
from text_generation_server.pb import generate_pb2
from text_generation_server.sampling import ChoiceContext
from text_generation_server.speculative.state import CostModel

from factories import PERSON, PHONE, decode_in_process, make_batch, make_request
from policies import SIX_LAYERS, write_policy
from prompt_sets import chat_text

JSON, REGEX = generate_pb2.GRAMMAR_TYPE_JSON, generate_pb2.GRAMMAR_TYPE_REGEX
# (prompt, request parameters): JSON schemas, a regex, a watermark, a watermarked JSON schema.
CASES = [
    ("Invent a person.", {"grammar": json.dumps(PERSON), "grammar_type": JSON}),
    ("Describe a chef from Paris.", {"grammar": json.dumps(PERSON), "grammar_type": JSON}),
    ("What is the phone number of the town hall?", {"grammar": PHONE, "grammar_type": REGEX}),
    ("Tell me about the sea.", {"watermark": True}),
    ("A famous painter.", {"grammar": json.dumps(PERSON), "grammar_type": JSON, "watermark": True}),
]
NEW_TOKENS = 40


def generate(lm: CausalLM, requests: list[generate_pb2.Request]) -> tuple[dict[int, list[int]], int, int]:
    """Decode to completion in-process with grammars enabled; token ids, drafts proposed and kept."""
    choice = ChoiceContext(lm.grammar_compiler())
    out = decode_in_process(lm, CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers,
                                                      lm.eos_token_ids, 1000, choice))
    stats = [report.stats for report in out.reports.values() if "drafted" in report.stats]  # the last reports
    return out.tokens, sum(int(s["drafted"]) for s in stats), sum(int(s["accepted"]) for s in stats)


@pytest.fixture(scope="module")
def pair(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, CausalLM]:
    model = load_model(model_path, LoadConfig())
    policy = write_policy(model, tmp_path_factory.mktemp("policy") / "policy.json", SIX_LAYERS)
    off, verified = make_lm(model_path, model, "off", None), make_lm(model_path, model, "verified", policy)
    verified.auto_off = False  # every decode step is a draft-verify cycle
    # A fixed cost model where drafting pays (drafts grow to several tokens), instead of measuring
    # one at first use: only the draft length depends on it, never the tokens.
    verified.costs.model = CostModel.flat(step_s=0.030, verify_s=(0.030, 0.033, 0.036, 0.039, 0.042, 0.045, 0.048),
                                         layer_s=0.001)
    return off, verified


def _requests(lm: CausalLM) -> list[generate_pb2.Request]:
    return [make_request(i, chat_text(lm.tokenizer, prompt), NEW_TOKENS, **params)  # type: ignore[arg-type]
            for i, (prompt, params) in enumerate(CASES)]


def _check_shapes(lm: CausalLM, tokens: dict[int, list[int]]) -> None:
    """Each finished constrained output (it ended before NEW_TOKENS) has its grammar's shape."""
    finished = 0
    for i, (_, params) in enumerate(CASES):
        text = lm.tokenizer.decode(tokens[i], skip_special_tokens=True)
        if len(tokens[i]) == NEW_TOKENS or "grammar_type" not in params:
            continue
        finished += 1
        if params["grammar_type"] == JSON:
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert re.fullmatch(PHONE, text), text
    assert finished >= 2, "at least two constrained outputs ended within NEW_TOKENS"


def test_greedy_verified_under_grammar_equals_off_alone(pair: tuple[CausalLM, CausalLM]) -> None:
    off, verified = pair
    drafted = accepted = 0
    for request in _requests(off):
        expected, _, _ = generate(off, [request])
        got, d, a = generate(verified, [request])
        assert got == expected, f"request {request.id} ({CASES[request.id][0]!r})"
        drafted, accepted = drafted + d, accepted + a
    print(f"\n{len(CASES)} constrained requests: {drafted} drafted, {accepted} accepted")
    assert drafted > 0 and accepted > 0, "drafts were proposed and kept under the grammar"


def test_greedy_verified_under_grammar_equals_off_in_one_batch(pair: tuple[CausalLM, CausalLM]) -> None:
    """All cases together plus an unconstrained row: rows accept different numbers of drafts."""
    off, verified = pair
    requests = [*_requests(off), make_request(99, chat_text(off.tokenizer, "Hello"), NEW_TOKENS)]
    expected, _, _ = generate(off, requests)
    got, drafted, accepted = generate(verified, requests)
    assert got == expected
    assert drafted > 0 and accepted > 0
    _check_shapes(off, expected)
