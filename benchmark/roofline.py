"""How close the fast runner's decode step is to this machine's memory roofline.

A decode step at batch 1 reads every weight once, so tokens/s can never exceed
(read bandwidth) / (weight bytes per token). This measures, interleaved, median of repeats:
- the machine's read bandwidth: `torch.sum` over a buffer as large as the fp32 weights;
- the default model's weight bytes in fp32 and bf16 (the tied lm_head counted once);
- the fast runner's decode step (batch 1, fused decode layers) in fp32 and bf16;
and reports the ceiling each dtype implies and the fraction of it the runner reaches.

Usage: .venv/bin/python benchmark/roofline.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.models.loading import LoadConfig, load_model
from text_generation_server.models.runner import FastLlamaRunner, FastRunnerConfig, ForwardInputs

from common import write_results


def weight_bytes(runner: FastLlamaRunner) -> int:
    """Bytes a decode step reads whole: every layer's weights (tensors, the kernels' projections,
    bitsandbytes modules), the final norm and the lm_head (of the embedding only one row per
    token is read: not counted)."""
    total = sum(t.numel() * t.element_size() for t in (runner.lm_head, runner.final_norm))
    for layer in runner.layers:
        for part in (*layer.pre, *layer.post):
            if isinstance(part, torch.Tensor):
                total += part.numel() * part.element_size()
            elif isinstance(part, tuple):  # bitsandbytes modules
                total += sum(t.numel() * t.element_size() for m in part for t in (*m.parameters(), *m.buffers()))
            elif part is not None:
                total += part.nbytes
    return total


def read_seconds(buffer: torch.Tensor, reads: int = 5) -> float:
    """The fastest of `reads` sums over the buffer: the bandwidth the machine attains (a single read
    on this shared machine measured anywhere between 6 and 40 GB/s)."""
    best = float("inf")
    for _ in range(reads):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return best


def step_seconds(runner: FastLlamaRunner, steps: int = 32) -> float:
    cache = runner.new_cache(1)
    ids = torch.arange(1, 9)[None]
    runner.forward(ForwardInputs.contiguous(ids), cache)
    start = time.perf_counter()
    for i in range(steps):
        runner.forward(ForwardInputs.contiguous(ids[:, :1], 8 + i), cache)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(download_weights(DEFAULT_MODEL_ID), LoadConfig())
    runners = {"fp32": FastLlamaRunner(model), "bf16": FastLlamaRunner(model, FastRunnerConfig(dtype=torch.bfloat16))}
    sizes = {name: weight_bytes(runner) for name, runner in runners.items()}
    buffer = torch.ones(sizes["fp32"] // 4)
    samples: dict[str, list[float]] = {"read": [], **{name: [] for name in runners}}
    for runner in runners.values():
        step_seconds(runner, 4)
    for _ in range(args.repeats):
        samples["read"].append(read_seconds(buffer))
        for name, runner in runners.items():
            samples[name].append(step_seconds(runner))
    bandwidth = buffer.numel() * 4 / statistics.median(samples["read"])
    print(f"read bandwidth ({args.threads} threads, {buffer.numel() * 4 / 1e6:.0f} MB): {bandwidth / 1e9:.1f} GB/s")
    report: dict[str, dict[str, float]] = {}
    for name in runners:
        step = statistics.median(samples[name])
        ceiling = bandwidth / sizes[name]
        report[name] = {"weight_mb": sizes[name] / 1e6, "step_ms": step * 1e3, "tokens_per_s": 1 / step,
                        "roofline_tokens_per_s": ceiling, "fraction_of_roofline": 1 / step / ceiling}
        print(f"{name}: {sizes[name] / 1e6:.0f} MB of weights per token -> roofline {ceiling:.1f} tok/s; "
              f"decode step {step * 1e3:.1f} ms = {1 / step:.1f} tok/s ({1 / step / ceiling:.0%} of the roofline)")
    write_results("roofline", {"threads": args.threads, "repeats": args.repeats,
                               "read_bandwidth_gb_s": bandwidth / 1e9, "dtypes": report,
                               "samples_s": samples})


if __name__ == "__main__":
    main()
