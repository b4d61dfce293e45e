"""What seeded sampling's coupling costs in accepted drafts (speculative/accept.py).

Verified mode keeps a sampled draft when the draft distribution q and the full model's p, raced
with the same position noise, pick the same token. Speculative rejection sampling would keep it
with probability sum(min(p, q)) = 1 - TV, a little more, but then a seeded request's tokens would
depend on its drafts. This measures both on real positions: per prompt class (held-out prompts,
layerskip_cli/prompt_classes.py), along the model's greedy continuation, the first draft of the
policy's default rule (skipped layers, graceful biases, reduced head) against the full model at
each position, p and q warped at `--temperature`; the coupling's P(match) is a Monte Carlo
estimate over `--draws` noise vectors per position (those of seeds 0..draws-1 at that position).
JSON in benchmark/results/sampling_coupling.json.

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/sampling_coupling.py
       [--model ID] [--dtype bfloat16] [--temperature 0.7] [--tokens 32] [--draws 300]
       [--prompts-per-class 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from layerskip_modes import model_lms, prompt_texts

from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.models.runner import ForwardInputs
from text_generation_server.sampling.chooser import position_noise, race

from common import write_results


def first_draft_acceptance(lm: CausalLM, prompt: str, tokens: int, temperature: float,
                           draws: int) -> tuple[list[float], list[float]]:
    """Per position of the greedy continuation: (1 - TV, the coupling's P(match))."""
    runner, rule = lm.runner, lm.planner.scheduler.policy.table.default
    head = lm.heads.get(rule.draft.vocab)
    ids = lm.tokenizer(prompt)["input_ids"]
    n = len(ids)
    cache = runner.new_cache(1)
    x = int(runner.forward(ForwardInputs.contiguous(torch.tensor([ids])), cache)[0, -1].argmax())
    draft_model = runner.draft_model(rule.skip, head.weight if head is not None else None, lm.planner.biases)
    rejection, coupling = [], []
    for _ in range(tokens):
        step = ForwardInputs.contiguous(torch.tensor([[x]]), n)
        q = draft_model.forward(step, cache)[0, -1].float()
        cache.crop(n)  # the draft's keys and values go; the full forward writes the true ones
        if head is not None:
            q = head.to_full(q, runner.vocab_size)
        logits = runner.forward(step, cache)[0, -1].float()
        logp, logq = (logits / temperature).log_softmax(-1), (q / temperature).log_softmax(-1)
        rejection.append(float(torch.minimum(logp.exp(), logq.exp()).sum()))
        noises = (position_noise(seed, n, logp.shape[-1]) for seed in range(draws))
        coupling.append(sum(int(race(logp, e) == race(logq, e)) for e in noises) / draws)
        n, x = n + 1, int(logits.argmax())
    return rejection, coupling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--prompts-per-class", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    lms, policy = model_lms(args.model, args.dtype, "auto", 6)
    lm = lms["verified"]
    default = lm.planner.scheduler.policy.table.default
    print(f"{args.model} {args.dtype}: policy {policy}, default rule skips {sorted(default.skip)} "
          f"with a {default.draft.vocab or 'full'}-word head", flush=True)
    rows: dict[str, Any] = {}
    for name, prompts in prompt_texts(lm.tokenizer, args.prompts_per_class).items():
        rejection, coupling = [], []
        for prompt in prompts:
            r, c = first_draft_acceptance(lm, prompt, args.tokens, args.temperature, args.draws)
            rejection += r
            coupling += c
        rows[name] = {"rejection_sampling": statistics.mean(rejection), "coupling": statistics.mean(coupling),
                      "positions": len(rejection)}
        print(f"  {name:<15} first-draft acceptance: rejection sampling {rows[name]['rejection_sampling']:.3f}, "
              f"coupling {rows[name]['coupling']:.3f} ({len(rejection)} positions)", flush=True)
    write_results("sampling_coupling", {"args": vars(args), "policy": policy, "rows": rows})


if __name__ == "__main__":
    main()
