"""Grammar masks on the real default tokenizer: what they allow, caching, rollback, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from text_generation_server.grammar import GrammarCompiler, GrammarKind, GrammarSpec

VOCAB = 49152  # the default model's logits width


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])


def _greedy_under_grammar(compiler: GrammarCompiler, spec: GrammarSpec, preferred: list[int], eos: int,
                          max_tokens: int = 64) -> list[int]:
    """Walk the grammar choosing, at each step, the allowed token that comes first in `preferred`
    (a stand-in for a model's ranking); stops at EOS."""
    matcher = compiler.matcher(spec)
    rank = torch.full((VOCAB,), -1.0)
    rank[torch.tensor(preferred)] = torch.linspace(1000.0, 1.0, len(preferred))
    out: list[int] = []
    for _ in range(max_tokens):
        logits = matcher.mask_(rank.clone())
        token = int(logits.argmax())
        assert math.isfinite(float(logits[token])), "the mask left no token allowed"
        matcher.accept(token)
        out.append(token)
        if token == eos:
            break
    return out


def test_regex_mask_forces_a_matching_text(tokenizer: PreTrainedTokenizerBase, compiler: GrammarCompiler) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-(yes|no)")
    preferred = tokenizer("hello 12345 no yes - maybe", add_special_tokens=False)["input_ids"]
    preferred += [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    out = _greedy_under_grammar(compiler, spec, preferred, tokenizer.eos_token_id)
    assert out[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(out[:-1])
    import re

    assert re.fullmatch(r"[0-9]{3}-(yes|no)", text), text


def test_json_schema_mask_allows_a_valid_document_and_refuses_a_wrong_type(
        tokenizer: PreTrainedTokenizerBase, compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    spec = GrammarSpec(GrammarKind.JSON, json.dumps(schema))
    document = tokenizer('{"n": 42, "ok": true}', add_special_tokens=False)["input_ids"]
    matcher = compiler.matcher(spec)
    for position, token in enumerate(document):
        allowed = matcher.mask_(torch.zeros(VOCAB))
        assert math.isfinite(float(allowed[token])), f"token {position} of a valid document was masked"
        if position == 3:  # after '{"n": ' a string or a boolean is not an integer
            for wrong in tokenizer(' "x', add_special_tokens=False)["input_ids"][:1] + [
                    tokenizer.convert_tokens_to_ids("Ġtrue")]:
                assert allowed[wrong] == -math.inf
        matcher.accept(token)
    end = matcher.mask_(torch.zeros(VOCAB))
    assert torch.isfinite(end).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    matcher.accept(tokenizer.eos_token_id)
    assert matcher.terminated


def test_compiled_grammars_are_cached_by_content(tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    spec = GrammarSpec(GrammarKind.REGEX, "a+b")
    compiler.matcher(spec)
    compiler.matcher(GrammarSpec(GrammarKind.REGEX, "a+b"))
    assert compiler.compilations == 1
    compiler.matcher(GrammarSpec(GrammarKind.REGEX, "a+c"))
    assert compiler.compilations == 2


def test_allows_counts_an_accepted_prefix_and_rollback_restores_the_state(
        tokenizer: PreTrainedTokenizerBase, compiler: GrammarCompiler) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "(cat|dog) (runs|sleeps)")
    ids = tokenizer("cat sleeps", add_special_tokens=False)["input_ids"]
    wrong = tokenizer("dog", add_special_tokens=False)["input_ids"]
    matcher = compiler.matcher(spec)
    assert matcher.allows(ids) == len(ids)
    assert matcher.allows([ids[0], *wrong]) == 1  # "cat" then "dog" breaks the grammar
    before = matcher.mask_(torch.zeros(VOCAB))
    for token in ids:
        matcher.accept(token)
    matcher.rollback(len(ids))
    assert torch.equal(matcher.mask_(torch.zeros(VOCAB)), before)


@pytest.mark.parametrize(("kind", "value", "message"), [
    (GrammarKind.JSON, "{not json", "the JSON schema is not JSON"),
    (GrammarKind.REGEX, "(unclosed", "regex grammar does not compile"),
])
def test_a_bad_grammar_is_refused_naming_it(compiler: GrammarCompiler, kind: GrammarKind, value: str,
                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.matcher(GrammarSpec(kind, value))
