"""Grammar engines side by side: time to compute one token mask, on the default model's tokenizer.

For a JSON schema and a regex, each engine compiles the grammar once, then walks a document
that matches it token by token, computing the mask of allowed next tokens before each token
(the work a constrained decode step adds). Engines: xgrammar (what the shard uses),
llguidance, outlines-core (what upstream TGI uses). Rounds interleave the engines; the
report gives per-engine medians and p99 over every mask of every round, and compile times.

Usage: .venv/bin/python benchmark/grammar_mask.py [--rounds 5]
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


def xgrammar_engine(tokenizer: PreTrainedTokenizerBase, vocab: int) -> Callable[[str, str], Walker]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1)

    def compile_grammar(kind: str, grammar: str) -> Walker:
        compiled = compiler.compile_json_schema(grammar) if kind == "json" else compiler.compile_regex(grammar)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        logits = torch.zeros((1, vocab))

        def walk(ids: list[int]) -> list[float]:
            matcher, times = xgr.GrammarMatcher(compiled), []
            for token in ids:
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                times.append(time.perf_counter() - start)
                assert matcher.accept_token(token), f"xgrammar refused token {token}"
            return times

        return walk

    return compile_grammar


def llguidance_engine(tokenizer: PreTrainedTokenizerBase, vocab: int) -> Callable[[str, str], Walker]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile_grammar(kind: str, grammar: str) -> Walker:
        text = (llguidance.LLMatcher.grammar_from_json_schema(grammar) if kind == "json"
                else llguidance.LLMatcher.grammar_from_regex(grammar))
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        logits = torch.zeros((1, vocab))

        def walk(ids: list[int]) -> list[float]:
            matcher, times = llguidance.LLMatcher(lltok, text), []
            for token in ids:
                start = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
                times.append(time.perf_counter() - start)
                assert matcher.consume_token(token), f"llguidance refused token {token}: {matcher.get_error()}"
            return times

        return walk

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
            guide, times = outlines_core.Guide(index), []
            for token in ids:
                start = time.perf_counter()
                allowed = torch.tensor(guide.get_tokens(), dtype=torch.long)
                logits.fill_(-torch.inf).index_fill_(0, allowed, 0.0)
                times.append(time.perf_counter() - start)
                guide.advance(token)
            return times

        return walk

    return compile_grammar


ENGINES = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine, "outlines-core": outlines_engine}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
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
    write_results("grammar_mask", results)


if __name__ == "__main__":
    main()
