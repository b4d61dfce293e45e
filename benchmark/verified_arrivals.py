"""Verified mode under continuous arrivals, as a router feeds a shard: `--rows` requests decode
at once and a new one is prefilled and joined to the batch as soon as one finishes; prompts of
the four classes interleaved, lengths staggered (16-56 new tokens), greedy, EOS ignored.

Modes, one after another per repeat (order reversed every other repeat), on one loaded model:
off; verified (shipped policy, adaptation as served); verified with group learning disabled (a
DraftController whose multi-row plans never take LEARN_FLOOR's learning cycles: drafting in
groups as before 2026-12-05); `--speculate 6`. Tokens/s counts decode steps only (prefills are
not timed); every mode's tokens are checked against off's. The question it answers: does the
learning of new rows in groups pay when some row of a group is nearly always new?

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/verified_arrivals.py
       [--model ID] [--dtype bfloat16] [--rows 4] [--requests 32] [--repeats 2] [--out NAME]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace
from typing import Any

import layerskip_modes
import torch

from text_generation_server.engine.batch import CausalLMBatch, RequestState
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.speculative.controller import CyclePlan, DraftController

from common import write_results
from factories import make_batch, make_request

LENGTHS = (16, 40, 24, 56, 32, 48)
CLASS_ORDER = ("code_completion", "chat", "summarise", "code_edit")


class NoGroupLearning(DraftController):
    """Multi-row plans with LEARN_FLOOR out of reach: groups draft only what clears their bar."""

    def plan_cycle(self, states: list[RequestState]) -> CyclePlan:
        if len(states) == 1:
            return super().plan_cycle(states)
        served, self.tuning = self.tuning, replace(self.tuning, learn_floor=float("inf"))
        try:
            return super().plan_cycle(states)
        finally:
            self.tuning = served


def decode(lm: CausalLM, jobs: list[tuple[str, int]], rows: int) -> tuple[float, dict[int, list[int]]]:
    """Decode every job with `rows` at a time; returns decode tokens/s and each request's tokens."""
    lm.controller.rules.clear()  # each run starts from the policy's priors
    pending = list(enumerate(jobs))
    tokens: dict[int, list[int]] = {}
    seconds, generated, batch_id = 0.0, 0, 0

    def admit(count: int) -> CausalLMBatch | None:
        nonlocal batch_id
        take, pending[:] = pending[:count], pending[count:]
        if not take:
            return None
        batch_id += 1
        requests = [make_request(i, text, new, ignore_eos=True) for i, (text, new) in take]
        batch = CausalLMBatch.from_pb(make_batch(batch_id, requests), lm.tokenizer, lm.runner.num_layers,
                                      lm.eos_token_ids, 8192)
        generations, joined, _ = lm.generate_token(batch)  # the prefill
        for g in generations:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        return joined

    batch = admit(rows)
    while batch is not None:
        start = time.perf_counter()
        generations, after, _ = lm.generate_token(batch)
        seconds += time.perf_counter() - start
        for g in generations:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
            generated += len(g.tokens.ids)
        alive = [s.id for s in batch.requests if not s.finished and s.audit_of is None]
        kept = after.filter(alive) if after is not None and alive else None
        if len(alive) < rows:
            joined = [b for b in (kept, admit(rows - len(alive))) if b is not None]
            kept = CausalLMBatch.concatenate(joined) if len(joined) > 1 else (joined[0] if joined else None)
        batch = kept
    return generated / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="verified_arrivals")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    lms, policy = layerskip_modes.model_lms(args.model, args.dtype, "auto", 6)
    texts = layerskip_modes.prompt_texts(lms["off"].tokenizer, 2)
    order = [t for group in zip(*(texts[c] for c in CLASS_ORDER), strict=True) for t in group]
    jobs = [(order[i % len(order)], LENGTHS[i % len(LENGTHS)]) for i in range(args.requests)]
    verified = lms["verified"]
    no_group_learning = copy.copy(verified)  # the verified model as loaded (heads, cost model), its controller swapped
    served = verified.controller
    no_group_learning.controller = NoGroupLearning(verified.costs, served.max_draft, served.ngram, served.dtype,
                                                   served.kernels, served.tuning)
    modes = {"off": lms["off"], "verified": verified, "verified_no_group_learning": no_group_learning,
             "speculate": lms["speculate"]}
    runs: dict[str, list[float]] = {name: [] for name in modes}
    outputs: dict[str, dict[int, list[int]]] = {}
    for repeat in range(args.repeats):
        names = list(modes) if repeat % 2 == 0 else list(modes)[::-1]
        for name in names:
            tps, tokens = decode(modes[name], jobs, args.rows)
            runs[name].append(tps)
            outputs[name] = tokens
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {tps:.1f} tok/s", flush=True)
        for name, tokens in outputs.items():
            if tokens != outputs["off"]:
                raise SystemExit(f"{name}'s greedy tokens differ from off's (repeat {repeat + 1})")
    off = statistics.median(runs["off"])
    result: dict[str, Any] = {"args": vars(args), "policy": policy, "tokens_per_s": runs,
                              "ratio_to_off": {name: statistics.median(v) / off for name, v in runs.items()}}
    print({name: round(r, 3) for name, r in result["ratio_to_off"].items()}, flush=True)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
