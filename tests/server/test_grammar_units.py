"""Grammar masks on the real default tokenizer: what they allow, caching, rollback, refusals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from text_generation_server.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from text_generation_server.grammar_limits import GrammarLimits

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


def _object(num_properties: int, required: bool = False) -> str:
    """An object schema of `num_properties` string properties: optional ones cost the compile
    far more (one of 500 optional properties took 0.4 s, 1,000 took 2.3 s)."""
    names = [f"p{i}" for i in range(num_properties)]
    schema: dict[str, object] = {"type": "object", "properties": {n: {"type": "string"} for n in names}}
    if required:
        schema["required"] = names
    return json.dumps(schema)


def _nested(depth: int) -> str:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return json.dumps(schema)


@pytest.mark.parametrize("kind, value, limit", [
    (GrammarKind.JSON, _object(257),
     "an object of the JSON schema has 257 properties; this server compiles at most 256"),
    (GrammarKind.JSON, _nested(40), "nests deeper than 32 levels of JSON objects"),
    (GrammarKind.JSON, json.dumps({"type": "object", "properties": {
        f"o{j}": json.loads(_object(200)) for j in range(6)}}), "has more than 1024 JSON objects"),
    (GrammarKind.JSON, json.dumps({"type": "object", "properties": {"a": {"enum": ["x" * 70000]}}}),
     "the json grammar has 70055 bytes; this server compiles at most 65536"),
    (GrammarKind.REGEX, "a" * 70000, "the regex grammar has 70000 bytes; this server compiles at most 65536"),
    (GrammarKind.JSON, "[" * 100000 + "]" * 100000, "grammar is too"),  # deeper than Python's json parses
])
def test_a_grammar_past_a_limit_is_refused_before_it_compiles(tokenizer: PreTrainedTokenizerBase, kind: GrammarKind,
                                                               value: str, limit: str) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    for refuse in (compiler.compile, lambda spec: asyncio.run(compiler.prepare(spec))):
        started = time.monotonic()
        with pytest.raises(ValueError, match=re.escape(limit)):
            refuse(GrammarSpec(kind, value))
        assert time.monotonic() - started < 1.0
    assert compiler.compilations == 0


def test_a_grammar_compiles_off_the_event_loop(tokenizer: PreTrainedTokenizerBase) -> None:
    """While a slow grammar compiles (256 optional properties, within the limits), the loop runs."""
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    spec = GrammarSpec(GrammarKind.JSON, _object(256))

    async def main() -> tuple[int, float]:
        ticks = 0
        task = asyncio.create_task(compiler.prepare(spec))
        started = time.monotonic()
        while not task.done():
            await asyncio.sleep(0.005)
            ticks += 1
        await task
        return ticks, time.monotonic() - started

    ticks, elapsed = asyncio.run(main())
    print(f"compiled in {elapsed:.2f} s with {ticks} ticks of the loop")
    assert ticks >= 5 and compiler.compilations == 1
    assert compiler.matcher(spec) is not None  # the step finds it compiled


def test_a_compile_past_its_deadline_refuses_and_is_kept_for_a_retry(tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id],
                               GrammarLimits(compile_timeout_s=0.01))
    spec = GrammarSpec(GrammarKind.JSON, _object(256))

    async def main() -> None:
        with pytest.raises(ValueError, match=r"did not compile within --grammar-compile-timeout \(0.01 s\)"):
            await compiler.prepare(spec)
        with pytest.raises(ValueError, match="did not compile within"):
            compiler.matcher(spec)  # the step does not compile it again on its own thread
        while compiler.compilations == 0:  # it finishes in the background
            await asyncio.sleep(0.05)
        await compiler.prepare(spec)  # a retry finds it compiled

    asyncio.run(main())
    assert compiler.compilations == 1


def test_a_compile_nobody_waits_for_is_dropped_and_too_many_are_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    """The worker compiles one grammar at a time: a queued one whose client left never starts,
    and more than max_pending distinct grammars at once are refused."""
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], GrammarLimits(max_pending=2))
    slow, queued, third = (GrammarSpec(GrammarKind.JSON, _object(n)) for n in (256, 255, 254))

    async def main() -> None:
        first = asyncio.create_task(compiler.prepare(slow))
        second = asyncio.create_task(compiler.prepare(queued))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="grammar compiler busy: 2 grammars are compiling"):
            await compiler.prepare(third)
        second.cancel()  # its client went
        await first
        with contextlib.suppress(asyncio.CancelledError):
            await second

    asyncio.run(main())
    assert compiler.compilations == 1


def test_a_bad_grammar_is_refused_by_prepare_and_the_refusal_is_kept(tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    spec = GrammarSpec(GrammarKind.REGEX, "(unclosed")
    for _ in range(2):
        with pytest.raises(ValueError, match="regex grammar does not compile"):
            asyncio.run(compiler.prepare(spec))
    with pytest.raises(ValueError, match="regex grammar does not compile"):
        compiler.matcher(spec)
