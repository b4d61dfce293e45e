"""What a forward of k new tokens costs next to a one-token decode step (draft verification).

Verified mode drafts k tokens with skipped layers and checks them with one full forward of
k + 1 tokens; it pays only if that forward costs about one step. This times, at batch 1 and a
fixed cache length (the cache is cropped back after every sample), forwards of 1..`--max-k`
new tokens with logits for every new position (as verification asks), interleaved (k = 1, 2,
.., max-k, then again), median of `--repeats`, and reports verify(k) / step where step =
verify(1). The fast runner's kernels take up to 16 activation rows (rows x new tokens) in one
weight stream, so k <= 16 should cost about a step.

Usage: .venv/bin/python benchmark/verify_cost.py [--model default|qwen0.5b] [--dtype float32]
       [--repeats 15] [--threads 2] [--context 64]
Results: benchmark/results/verify_cost_<model>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from text_generation_server.download import DEFAULT_MODEL_ID, QWEN_CODER_05B_ID, download_weights
from text_generation_server.models.loading import LoadConfig, load_model
from text_generation_server.models.runner import FastLlamaRunner, ForwardInputs, KVCache

from common import write_results

MODELS = {"default": DEFAULT_MODEL_ID, "qwen0.5b": QWEN_CODER_05B_ID}


def forward_seconds(runner: FastLlamaRunner, cache: KVCache, context: int, k: int) -> float:
    """One forward of k new tokens after `context` cached ones (the cache is cropped back after)."""
    inputs = ForwardInputs.contiguous(torch.arange(100, 100 + k)[None], context, last_only=False)
    start = time.perf_counter()
    runner.forward(inputs, cache)
    seconds = time.perf_counter() - start
    cache.crop(context)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=64, help="cached tokens before the forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = FastLlamaRunner(load_model(download_weights(MODELS[args.model]), LoadConfig(dtype=args.dtype)))
    cache = runner.new_cache(1)
    prompt = torch.arange(1, args.context + 1)[None]
    runner.forward(ForwardInputs.contiguous(prompt), cache)
    samples: dict[int, list[float]] = {k: [] for k in range(1, args.max_k + 1)}
    for k in samples:  # warm-up
        forward_seconds(runner, cache, args.context, k)
    for _ in range(args.repeats):
        for k, values in samples.items():
            values.append(forward_seconds(runner, cache, args.context, k))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    step = medians[1]
    print(f"{args.model} {args.dtype}, batch 1, {args.context} cached tokens, {args.threads} threads, CPU kernels: "
          f"{runner.cpu_kernels}, median of {args.repeats} interleaved repeats")
    print(f"{'k':>3}{'ms':>9}{'verify(k) / step':>19}")
    for k, value in medians.items():
        print(f"{k:>3}{value * 1e3:>9.1f}{value / step:>19.2f}")
    worst = max(medians[k + 1] / step for k in range(1, 5) if k + 1 in medians)
    verdict = "met" if worst <= 1.15 else "NOT met"
    print(f"target verify(k + 1) / step <= 1.15 for k <= 4: worst {worst:.2f} ({verdict})")
    write_results(f"verify_cost_{args.model}", {
        "settings": vars(args), "cpu_kernels": runner.cpu_kernels, "step_ms": step * 1e3,
        "verify_ms": {str(k): v * 1e3 for k, v in medians.items()},
        "verify_over_step": {str(k): v / step for k, v in medians.items()},
        "samples_s": {str(k): v for k, v in samples.items()}, "worst_k_plus_1_over_step_k_le_4": worst})


if __name__ == "__main__":
    main()
