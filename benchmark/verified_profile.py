"""Where a verified cycle's time goes, against what the cost model priced it at.

The cost model (server/.../models/cost_model.py) is measured at warm-up on a 64-token context;
drafting pays only if served cycles cost what it says. This decodes one prompt class at batch 1
in `off` and `verified` side by side (interleaved step by step, as layerskip_modes.py does) and,
per step, records the stage times CausalLM reports (plan, forward, choose, stop) and, for
verified, the cycle it ran (model drafts and their number k, copied drafts, or a plain step).
It reports per kind of step: count, measured forward ms, the cost model's price, their ratio,
and the step's other stages; and the whole decode's tokens/s ratio. JSON in
benchmark/results/verified_profile.json.

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/verified_profile.py
       [--model ID] [--dtype float32] [--class code_completion] [--prompts 2] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from layerskip_modes import model_lms, prompt_texts

from text_generation_server.models.batch import CausalLMBatch
from text_generation_server.models.causal_lm import CausalLM

from common import write_results
from factories import make_batch, make_request


def _decode(lm: CausalLM, prompt: str, new_tokens: int) -> CausalLMBatch | None:
    request = make_request(0, prompt, new_tokens, ignore_eos=True)
    batch = CausalLMBatch.from_pb(make_batch(1, [request]), lm.tokenizer, lm.runner.num_layers, lm.eos_token_ids,
                                  8192)
    _, current, _ = lm.generate_token(batch)
    return current


def _kind(before: tuple[int, int, int, int], after: tuple[int, int, int, int]) -> str:
    model_cycles, model_drafted, ngram_cycles, ngram_drafted = (a - b for a, b in zip(after, before, strict=True))
    if model_cycles:
        return f"model k={model_drafted}"
    if ngram_cycles:
        return f"copy k={ngram_drafted}"
    return "plain"


def _counts(batch: CausalLMBatch) -> tuple[int, int, int, int]:
    spec = batch.requests[0].spec
    if spec is None:
        return (0, 0, 0, 0)
    return (spec.model.cycles, spec.model.drafted, spec.ngram.cycles, spec.ngram.drafted)


def profile(lms: dict[str, CausalLM], prompt: str, new_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """Per mode, one record per decode step: kind, tokens, context, wall and stage ms."""
    current = {mode: _decode(lms[mode], prompt, new_tokens) for mode in ("off", "verified")}
    steps: dict[str, list[dict[str, Any]]] = {mode: [] for mode in current}
    while any(b is not None for b in current.values()):
        for mode, batch in current.items():
            if batch is None:
                continue
            before, context = _counts(batch), len(batch.requests[0].all_ids)
            spec = batch.requests[0].spec
            draft = lms[mode].costs().draft_s(1, spec.skip, spec.vocab) if spec is not None and spec.skip else 0.0
            start = time.perf_counter()
            generations, current[mode], timings = lms[mode].generate_token(batch)
            wall = time.perf_counter() - start
            steps[mode].append({"kind": _kind(before, _counts(batch)) if mode == "verified" else "plain",
                                "tokens": sum(len(g.tokens.ids) for g in generations), "context": context,
                                "wall_ms": wall * 1e3, "plan_ms": timings.plan_ns / 1e6,
                                "forward_ms": timings.forward_ns / 1e6, "choose_ms": timings.choose_ns / 1e6,
                                "stop_ms": timings.stop_ns / 1e6, "draft_priced_ms": draft * 1e3})
    return steps


def summarize(lm: CausalLM, steps: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for mode, records in steps.items():
        for r in records:
            by_kind[f"{mode} {r['kind']}"].append(r)
    cost = lm.costs()
    out: dict[str, Any] = {}
    for name, records in sorted(by_kind.items()):
        kind = name.split(" ", 1)[1]
        price = cost.step_s * 1e3
        if kind != "plain":
            source, k = kind.split(" k=")
            draft_ms = statistics.median(r["draft_priced_ms"] for r in records)
            price = cost.full_s(1, int(k) + 1) * 1e3 + (int(k) * draft_ms if source == "model" else 0.0)
        forward = statistics.median(r["forward_ms"] for r in records)
        out[name] = {"count": len(records), "tokens": sum(r["tokens"] for r in records),
                     "forward_ms": forward, "priced_ms": price, "forward_over_price": forward / price,
                     "wall_ms": statistics.median(r["wall_ms"] for r in records),
                     **{f"{stage}_ms": statistics.median(r[f"{stage}_ms"] for r in records)
                        for stage in ("plan", "choose", "stop")},
                     "context": [min(r["context"] for r in records), max(r["context"] for r in records)]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--class", dest="prompt_class", default="code_completion")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="verified_profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    lms, policy = model_lms(args.model, args.dtype, "auto", 6)
    cost = lms["verified"].costs()
    texts = prompt_texts(lms["off"].tokenizer, args.prompts)[args.prompt_class]
    print(f"{args.model} {args.dtype}: policy {policy}; step {cost.step_s * 1e3:.1f} ms, verify(k+1)/step "
          f"{[round(s / cost.step_s, 2) for s in cost.verify_s]}; drafts "
          f"{[(sorted(s), v, round(one * 1e3, 1)) for (s, v), (one, _) in cost.drafts.items()]}", flush=True)
    steps: dict[str, list[dict[str, Any]]] = {"off": [], "verified": []}
    for prompt in texts:
        for mode, records in profile(lms, prompt, args.new_tokens).items():
            steps[mode].extend(records)
    rates = {mode: sum(r["tokens"] for r in rs) / sum(r["wall_ms"] for r in rs) * 1e3 for mode, rs in steps.items()}
    kinds = summarize(lms["verified"], steps)
    print(f"verified {rates['verified'] / rates['off']:.2f}x off ({rates['verified']:.1f} vs {rates['off']:.1f} "
          f"tokens/s)")
    for name, k in kinds.items():
        print(f"  {name:<22} n={k['count']:>3} forward {k['forward_ms']:6.1f} ms, priced {k['priced_ms']:6.1f} "
              f"({k['forward_over_price']:.2f}x); plan {k['plan_ms']:.1f} choose {k['choose_ms']:.1f} "
              f"stop {k['stop_ms']:.1f}; wall {k['wall_ms']:.1f}; context {k['context']}")
    write_results(args.out, {"args": vars(args), "policy": policy, "cost_model": cost.to_json(),
                             "ratio": rates["verified"] / rates["off"], "tokens_per_s": rates, "kinds": kinds,
                             "steps": steps})


if __name__ == "__main__":
    main()
