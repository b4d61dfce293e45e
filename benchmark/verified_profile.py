"""Where a verified cycle's time goes, against what the cost model priced it at.

The cost model (server/.../speculative/cost_model.py) is measured at warm-up on a 64-token context
(attention past it priced per cached column, at the context of each step);
drafting pays only if served cycles cost what it says. This decodes one prompt class in `off`
and `verified` side by side (interleaved step by step, as layerskip_modes.py does) and, per
step, records the stage times CausalLM reports (plan, forward, choose, stop) and, for verified,
the cycle it ran (model drafts and their number k, copied drafts, or a plain step).
It reports per kind of step and row count: count, measured forward ms, the cost model's price,
their ratio, and the step's other stages; and the whole decode's tokens/s ratio. `--batch N`
decodes N copies of each prompt together (how batch-4 cycles compare with their price);
`--temperature T` samples, row i with seed i. JSON in benchmark/results/verified_profile.json.

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/verified_profile.py
       [--model ID] [--dtype float32] [--quantize FORMAT] [--class code_completion] [--prompts 2] [--batch 1]
       [--new-tokens 64] [--min-gain-rows F] [--temperature T [--top-p P]]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch
from layerskip_modes import model_lms, prompt_texts

from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM

from common import write_results
from factories import make_batch, make_request


def _decode(lm: CausalLM, prompts: list[str], new_tokens: int, sampling: dict[str, Any]) -> CausalLMBatch | None:
    requests = [make_request(i, p, new_tokens, ignore_eos=True, seed=i, **sampling) for i, p in enumerate(prompts)]
    batch = CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers, lm.eos_token_ids,
                                  8192)
    _, current, _ = lm.generate_token(batch)
    return current


def _counts(batch: CausalLMBatch) -> list[tuple[int, int, int, int]]:
    """Per request: model cycles, model drafts, copy cycles, copied drafts so far."""
    return [(s.spec.model.cycles, s.spec.model.drafted, s.spec.ngram.cycles, s.spec.ngram.drafted)
            if s.spec is not None else (0, 0, 0, 0) for s in batch.requests]


def _cycle(lm: CausalLM, batch: CausalLMBatch, before: list[tuple[int, int, int, int]],
           context: int) -> tuple[str, float]:
    """The kind of step the batch just ran (from its requests' counts) and the cost model's price
    after `context` cached columns."""
    cost, rows = lm.costs(), len(before)
    deltas = [tuple(a - b for a, b in zip(after, was, strict=True)) for after, was in zip(_counts(batch), before,
                                                                                           strict=True)]
    model_k = max((d[1] for d in deltas if d[0]), default=0)
    copy_k = max((d[3] for d in deltas if d[2]), default=0)
    if model_k:
        skips = [s.spec.skip for s, d in zip(batch.requests, deltas, strict=True) if d[0] and s.spec is not None]
        vocab = next(s.spec.vocab for s, d in zip(batch.requests, deltas, strict=True) if d[0] and s.spec)
        draft = cost.draft_s(rows, frozenset.intersection(*skips), vocab, context)
        return f"model k={model_k}", cost.cycle_s(rows, model_k, draft, max(model_k, copy_k), context)
    if copy_k:
        return f"copy k={copy_k}", cost.full_s(rows, copy_k + 1, context)
    return "plain", cost.full_s(rows, 1, context)


def profile(lms: dict[str, CausalLM], prompts: list[str], new_tokens: int,
            sampling: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per mode, one record per decode step: kind, rows, tokens, context, price, wall and stage ms."""
    current = {mode: _decode(lms[mode], prompts, new_tokens, sampling) for mode in ("off", "verified")}
    steps: dict[str, list[dict[str, Any]]] = {mode: [] for mode in current}
    while any(b is not None for b in current.values()):
        for mode, batch in current.items():
            if batch is None:
                continue
            before, context = _counts(batch), max(len(s.all_ids) for s in batch.requests)
            start = time.perf_counter()
            generations, current[mode], timings = lms[mode].generate_token(batch)
            wall = time.perf_counter() - start
            kind, price = _cycle(lms[mode], batch, before, context)
            if current[mode] is None and mode == "verified":
                kind = "last step"  # a finished request's cycle is not counted (CausalLM.adapt_drafting)
            tokens = sum(len(g.tokens.ids) for g in generations)
            steps[mode].append({"kind": kind, "rows": len(before), "tokens": tokens, "context": context,
                                "priced_ms": price * 1e3, "wall_ms": wall * 1e3,
                                "plan_ms": timings.plan_ns / 1e6, "forward_ms": timings.forward_ns / 1e6,
                                "choose_ms": timings.choose_ns / 1e6, "stop_ms": timings.stop_ns / 1e6})
    return steps


def summarize(steps: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode, kind of step and row count: medians of the measured and priced figures."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for mode, records in steps.items():
        for r in records:
            by_kind[f"{mode} {r['kind']} x{r['rows']}"].append(r)
    out: dict[str, Any] = {}
    for name, records in sorted(by_kind.items()):
        medians = {key: statistics.median(r[key] for r in records)
                   for key in ("forward_ms", "priced_ms", "wall_ms", "plan_ms", "choose_ms", "stop_ms")}
        out[name] = {"count": len(records), "tokens": sum(r["tokens"] for r in records), **medians,
                     "forward_over_price": medians["forward_ms"] / medians["priced_ms"],
                     "context": [min(r["context"] for r in records), max(r["context"] for r in records)]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", default=None, help="bitsandbytes, bitsandbytes-nf4 or bitsandbytes-fp4")
    parser.add_argument("--class", dest="prompt_class", default="code_completion")
    parser.add_argument("--prompts", type=int, default=2, help="prompts of the class, decoded one after another")
    parser.add_argument("--batch", type=int, default=1, help="rows per decode (the prompt repeated)")
    parser.add_argument("--min-gain-rows", type=float, default=None,
                        help="the multi-row draft bar (DraftTuning.min_gain_rows) of --dtype on any kernels")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None,
                        help="seeded sampling at this temperature (row i has seed i) instead of greedy decoding")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="verified_profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    lms, policy = model_lms(args.model, args.dtype, "auto", 6, args.quantize)
    if args.min_gain_rows is not None:  # this run's bar for its dtype, whatever the kernels
        for lm in lms.values():
            lm.controller.tuning = replace(lm.controller.tuning, min_gain_rows={args.dtype: args.min_gain_rows})
    cost = lms["verified"].costs()
    texts = prompt_texts(lms["off"].tokenizer, args.prompts)[args.prompt_class]
    print(f"{args.model} {args.dtype} {args.quantize or ''}: policy {policy}; step {cost.step_s * 1e3:.1f} ms, "
          f"verify(k+1)/step {[round(s / cost.step_s, 2) for s in cost.verify_s]}; drafts "
          f"{[(sorted(s), v, round(one * 1e3, 1)) for (s, v), (one, _) in cost.drafts.items()]}", flush=True)
    sampling: dict[str, Any] = {}
    if args.temperature is not None:
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    steps: dict[str, list[dict[str, Any]]] = {"off": [], "verified": []}
    for prompt in texts:
        for mode, records in profile(lms, [prompt] * args.batch, args.new_tokens, sampling).items():
            steps[mode].extend(records)
    rates = {mode: sum(r["tokens"] for r in rs) / sum(r["wall_ms"] for r in rs) * 1e3 for mode, rs in steps.items()}
    kinds = summarize(steps)
    print(f"verified {rates['verified'] / rates['off']:.2f}x off ({rates['verified']:.1f} vs {rates['off']:.1f} "
          f"tokens/s)")
    for name, k in kinds.items():
        print(f"  {name:<26} n={k['count']:>3} forward {k['forward_ms']:6.1f} ms, priced {k['priced_ms']:6.1f} "
              f"({k['forward_over_price']:.2f}x); plan {k['plan_ms']:.1f} choose {k['choose_ms']:.1f} "
              f"stop {k['stop_ms']:.1f}; wall {k['wall_ms']:.1f}; context {k['context']}")
    write_results(args.out, {"args": vars(args), "policy": policy, "cost_model": cost.to_json(),
                             "ratio": rates["verified"] / rates["off"], "tokens_per_s": rates, "kinds": kinds,
                             "steps": steps})


if __name__ == "__main__":
    main()
