"""Grammar engines side by side, and what a JSON schema costs a real decode, on the default model.

Part 1, masks. For a JSON schema and a regex, each engine compiles the grammar once, then
walks a document that matches it token by token, computing the mask of allowed next tokens
and applying it to a logits row before each token (the work a constrained decode step adds).
Engines: xgrammar with its own `apply_token_bitmask_inplace`, `shard` (xgrammar's bitmask fill
plus the shard's cheap apply, text_generation_server.grammar: what the shard really runs),
llguidance, outlines-core (what upstream TGI uses). Rounds interleave the engines; the report
gives per-engine medians and p99 over every mask of every round, and compile times.

Part 2, decode. The shard's CausalLM (`off`, fast runner, float32) decodes the same chat prompt
for --new-tokens tokens with and without a JSON schema, rounds interleaved; the report gives
decode tokens/s (prefill excluded) of each and the shard's mask time per constrained token
(median, p99) measured inside that decode.

Usage: .venv/bin/python benchmark/grammar_mask.py [--rounds 5] [--threads 1]
(llguidance and outlines-core are benchmark-only: `pip install llguidance outlines-core`.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from text_generation_server import grammar as shard_grammar
from text_generation_server.download import DEFAULT_MODEL_ID, download_weights

from common import write_results

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
                       "address": {"city": "London", "zip": "12345"}})
REGEX = r"(\+1 )?\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_TEXT = "+1 (555) 123-4567 ext. 89"

# An engine: compile(kind, grammar) -> a walker; walker(token_ids) -> seconds of each mask.
Walker = Callable[[list[int]], list[float]]


def timed_walk(ids: list[int], mask: Callable[[], object], accept: Callable[[int], object]) -> list[float]:
    """Before each token of `ids`, `mask()` computes the allowed next tokens and applies them to a
    logits row (timed); then `accept` feeds the engine the token (untimed). Seconds of each mask."""
    times = []
    for token in ids:
        start = time.perf_counter()
        mask()
        times.append(time.perf_counter() - start)
        accept(token)
    return times


def bitmask_walker(vocab: int, bitmask: torch.Tensor, new_matcher: Callable[[], Any],
                   fill: Callable[[Any, torch.Tensor], object], apply: Callable[[torch.Tensor, torch.Tensor], object],
                   accept: Callable[[Any, int], None]) -> Walker:
    """A walker for the engines that fill a token bitmask and apply it in place to a `[1, vocab]`
    logits row (xgrammar, llguidance): a fresh matcher per walk; `accept` checks each token."""
    logits = torch.zeros((1, vocab))

    def walk(ids: list[int]) -> list[float]:
        matcher = new_matcher()

        def mask() -> None:
            fill(matcher, bitmask)
            apply(logits, bitmask)

        return timed_walk(ids, mask, lambda token: accept(matcher, token))

    return walk


def xgrammar_engine(tokenizer: PreTrainedTokenizerBase, vocab: int) -> Callable[[str, str], Walker]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1)

    def accept(matcher: xgr.GrammarMatcher, token: int) -> None:
        assert matcher.accept_token(token), f"xgrammar refused token {token}"

    def compile_grammar(kind: str, grammar: str) -> Walker:
        compiled = compiler.compile_json_schema(grammar) if kind == "json" else compiler.compile_regex(grammar)
        return bitmask_walker(vocab, xgr.allocate_token_bitmask(1, vocab), lambda: xgr.GrammarMatcher(compiled),
                              lambda matcher, bitmask: matcher.fill_next_token_bitmask(bitmask),
                              xgr.apply_token_bitmask_inplace, accept)

    return compile_grammar


def shard_engine(tokenizer: PreTrainedTokenizerBase, vocab: int) -> Callable[[str, str], Walker]:
    compiler = shard_grammar.GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])

    def compile_grammar(kind: str, grammar: str) -> Walker:
        spec = shard_grammar.GrammarSpec(shard_grammar.GrammarKind.JSON if kind == "json"
                                         else shard_grammar.GrammarKind.REGEX, grammar)
        compiler.compile(spec)
        logits = torch.zeros(vocab)

        def walk(ids: list[int]) -> list[float]:
            matcher = compiler.matcher(spec)

            def accept(token: int) -> None:
                matcher.accept(token)
                logits.zero_()

            return timed_walk(ids, lambda: matcher.mask_(logits), accept)

        return walk

    return compile_grammar


def llguidance_engine(tokenizer: PreTrainedTokenizerBase, vocab: int) -> Callable[[str, str], Walker]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def accept(matcher: llguidance.LLMatcher, token: int) -> None:
        assert matcher.consume_token(token), f"llguidance refused token {token}: {matcher.get_error()}"

    def compile_grammar(kind: str, grammar: str) -> Walker:
        text = (llguidance.LLMatcher.grammar_from_json_schema(grammar) if kind == "json"
                else llguidance.LLMatcher.grammar_from_regex(grammar))
        return bitmask_walker(vocab, llguidance.torch.allocate_token_bitmask(1, vocab),
                              lambda: llguidance.LLMatcher(lltok, text),
                              lambda matcher, bitmask: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
                              llguidance.torch.apply_token_bitmask_inplace, accept)

    return compile_grammar


def outlines_engine(tokenizer: PreTrainedTokenizerBase, vocab: int) -> Callable[[str, str], Walker]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    eos = tokenizer.eos_token_id
    strings: dict[str, list[int]] = {}
    for token_id in range(len(tokenizer)):
        if token_id in tokenizer.all_special_ids:
            continue
        text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
        strings.setdefault(text, []).append(token_id)
    vocabulary = outlines_core.Vocabulary(eos, strings)

    def compile_grammar(kind: str, grammar: str) -> Walker:
        index = outlines_core.Index(build_regex_from_schema(grammar) if kind == "json" else grammar, vocabulary)
        logits = torch.zeros(vocab)

        def walk(ids: list[int]) -> list[float]:
            guide = outlines_core.Guide(index)

            def mask() -> None:
                allowed = torch.tensor(guide.get_tokens(), dtype=torch.long)
                logits.fill_(-torch.inf).index_fill_(0, allowed, 0.0)

            return timed_walk(ids, mask, guide.advance)

        return walk

    return compile_grammar


ENGINES = {"xgrammar": xgrammar_engine, "shard": shard_engine, "llguidance": llguidance_engine,
           "outlines-core": outlines_engine}
# Part 2: a schema whose document is longer than --new-tokens, so every decoded token is masked.
DECODE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "biography": {"type": "string", "minLength": 600, "maxLength": 800},
    },
    "required": ["name", "age", "tags", "biography"],
    "additionalProperties": False,
}
DECODE_PROMPT = "Describe a famous scientist as a JSON object."


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def decode(rounds: int, new_tokens: int) -> dict[str, Any]:
    """Part 2: decode tokens/s with and without DECODE_SCHEMA, and the shard's mask times inside."""
    from text_generation_server.engine.batch import CausalLMBatch
    from text_generation_server.engine.causal_lm import CausalLM
    from text_generation_server.engine.skip_planner import LayerSkipConfig, SkipPlanner
    from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
    from text_generation_server.models.runner import build_runner
    from text_generation_server.pb import generate_pb2
    from text_generation_server.sampling import ChoiceContext

    path = download_weights(DEFAULT_MODEL_ID)
    model = load_model(path, LoadConfig())
    tokenizer = load_tokenizer(path)
    lm = CausalLM(build_runner(model, "fast"), tokenizer, frozenset({tokenizer.eos_token_id}),
                  SkipPlanner(model, LayerSkipConfig("off", None)))
    choice = ChoiceContext(lm.grammar_compiler())
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": DECODE_PROMPT}], tokenize=False,
                                           add_generation_prompt=True)
    mask_times: list[float] = []
    original = shard_grammar.GrammarMatcher.mask_

    def timed_mask(self: shard_grammar.GrammarMatcher, logits: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = original(self, logits)
        mask_times.append(time.perf_counter() - start)
        return out

    shard_grammar.GrammarMatcher.mask_ = timed_mask  # type: ignore[method-assign]

    def run(constrained: bool) -> float:
        grammar = {"grammar": json.dumps(DECODE_SCHEMA), "grammar_type": generate_pb2.GRAMMAR_TYPE_JSON}
        request = generate_pb2.Request(
            id=1, inputs=prompt, input_chunks=generate_pb2.Input(chunks=[generate_pb2.InputChunk(text=prompt)]),
            parameters=generate_pb2.NextTokenChooserParameters(
                temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0,
                **(grammar if constrained else {})),  # type: ignore[arg-type]
            stopping_parameters=generate_pb2.StoppingCriteriaParameters(max_new_tokens=new_tokens,
                                                                       ignore_eos_token=True),
            add_special_tokens=False)
        batch: Any = CausalLMBatch.from_pb(generate_pb2.Batch(id=1, requests=[request], size=1, max_tokens=new_tokens),
                                           tokenizer, lm.runner.num_layers, lm.eos_token_ids, 1000, choice)
        _, batch, _ = lm.generate_token(batch)  # prefill
        start, decoded = time.perf_counter(), 0
        while batch is not None:
            generations, batch, _ = lm.generate_token(batch)
            decoded += len(generations[0].tokens.ids)
        return decoded / (time.perf_counter() - start)

    run(True), run(False)  # warm up (the schema compiles once, outside the timed rounds)
    mask_times.clear()
    rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for _ in range(rounds):
        rates["plain"].append(run(False))
        rates["json_schema"].append(run(True))
    shard_grammar.GrammarMatcher.mask_ = original  # type: ignore[method-assign]
    out: dict[str, Any] = {"new_tokens": new_tokens, "tokens_per_s": {
        name: {"median": statistics.median(v), "runs": v} for name, v in rates.items()},
        "mask_us": {"median": statistics.median(mask_times) * 1e6, "p99": percentile(mask_times, 0.99) * 1e6,
                    "masks": len(mask_times)}}
    print(f"decode {new_tokens} tokens: plain {out['tokens_per_s']['plain']['median']:.1f} tok/s, "
          f"json_schema {out['tokens_per_s']['json_schema']['median']:.1f} tok/s; shard mask median "
          f"{out['mask_us']['median']:.1f} us p99 {out['mask_us']['p99']:.1f} us")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-decode", action="store_true", help="masks only (part 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(download_weights(DEFAULT_MODEL_ID)))
    vocab = 49152
    cases = {"json": (json.dumps(SCHEMA), DOCUMENT), "regex": (REGEX, REGEX_TEXT)}
    walkers: dict[tuple[str, str], Walker] = {}
    results: dict[str, Any] = {"compile_s": {}, "mask_us": {}}
    for name, engine in ENGINES.items():
        make = engine(tokenizer, vocab)
        for kind, (grammar, _) in cases.items():
            start = time.perf_counter()
            walkers[(name, kind)] = make(kind, grammar)
            results["compile_s"][f"{name}/{kind}"] = time.perf_counter() - start
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in walkers}
    for _ in range(args.rounds):
        for (name, kind), walk in walkers.items():
            ids = tokenizer(cases[kind][1], add_special_tokens=False)["input_ids"]
            samples[(name, kind)] += walk(ids)
    for (name, kind), times in samples.items():
        results["mask_us"][f"{name}/{kind}"] = {"median": statistics.median(times) * 1e6,
                                                "p99": percentile(times, 0.99) * 1e6, "masks": len(times)}
        print(f"{name:14s} {kind:5s} mask median {statistics.median(times) * 1e6:7.1f} us  "
              f"p99 {percentile(times, 0.99) * 1e6:7.1f} us  compile {results['compile_s'][f'{name}/{kind}']:.3f} s")
    results["threads"] = args.threads
    if not args.skip_decode:
        results["decode"] = decode(args.rounds, args.new_tokens)
    write_results("grammar_mask", results)


if __name__ == "__main__":
    main()
