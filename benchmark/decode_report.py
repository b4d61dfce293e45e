"""The tables and the issue's targets of benchmark/runner_decode.py, printed and written as JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# (name, numerator, denominator, at least): ratios of contestants' tokens/s; "roofline" is the
# fp32 ceiling of each round (read bandwidth / fp32 weight bytes per token).
TARGETS = [
    ("fp32 b1 / fp32 memory roofline", "fast fp32 b1", "roofline", 0.85),
    ("fp32 b1 / llama.cpp f32 b1", "fast fp32 b1", "llama.cpp f32 b1", 1.0),
    ("bf16 b1 / llama.cpp f16 b1", "fast bf16 b1", "llama.cpp f16 b1", 1.0),
    ("fp32 b8 / llama.cpp f32 b8", "fast fp32 b8", "llama.cpp f32 b8", 1.0),
    ("bf16 b8 / llama.cpp f16 b8", "fast bf16 b8", "llama.cpp f16 b8", 1.0),
    ("nf4 b1 / llama.cpp Q4_K_M b1", "fast nf4 b1", "llama.cpp q4_k_m b1", 1.0),
    ("nf4 b8 / llama.cpp Q4_K_M b8", "fast nf4 b8", "llama.cpp q4_k_m b8", 1.0),
    ("int8 b1 / llama.cpp Q8_0 b1", "fast int8 b1", "llama.cpp q8_0 b1", 1.0),
    ("int8 b8 / llama.cpp Q8_0 b8", "fast int8 b8", "llama.cpp q8_0 b8", 1.0),
    ("nf4 dense-head b1 / Q4_K_M b1", "fast nf4 dense-head b1", "llama.cpp q4_k_m b1", None),
    ("int8 dense-head b1 / Q8_0 b1", "fast int8 dense-head b1", "llama.cpp q8_0 b1", None),
    ("avx2 fp32 b1 / llama.cpp f32 b1", "fast fp32 avx2 b1", "llama.cpp f32 b1", None),
    ("avx2 bf16 b1 / llama.cpp f16 b1", "fast bf16 avx2 b1", "llama.cpp f16 b1", None),
]


def _common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _series(samples: dict[str, list[float]], name: str, fp32_bytes: int) -> list[float] | None:
    if name == "roofline":
        return [gb_s * 1e9 / fp32_bytes for gb_s in samples["read GB/s"]] if "read GB/s" in samples else None
    return samples.get(name)


def targets(samples: dict[str, list[float]], fp32_bytes: int) -> dict[str, dict[str, Any]]:
    """Each target's median ratio, the range over rounds, and whether the median meets it."""
    out: dict[str, dict[str, Any]] = {}
    for label, top, bottom, least in TARGETS:
        num, den = _series(samples, top, fp32_bytes), _series(samples, bottom, fp32_bytes)
        if num is None or den is None:
            continue
        per_round = [a / b for a, b in zip(num, den, strict=False)]
        median = statistics.median(num) / statistics.median(den)
        out[label] = {"median_ratio": median, "round_min": min(per_round), "round_max": max(per_round),
                      "target": least, "met": None if least is None else median >= least}
    return out


def _print_table(medians: dict[str, float], same: dict[str, int], reference: list[int]) -> None:
    print(f"{'contestant':<30}{'tok/s':>9}{'x generate()':>14}{'x llama.cpp f32':>17}{'x llama.cpp f16':>17}"
          f"{'prefix = fp32':>15}")
    for name, value in medians.items():
        if name == "read GB/s":
            continue
        batch = name.rsplit(" ", 1)[1]
        ratios = []
        for ref in (f"generate() fp32 {batch}", f"llama.cpp f32 {batch}", f"llama.cpp f16 {batch}"):
            ratios.append(f"{value / medians[ref]:.2f}" if ref in medians else "-")
        matching = f"{same.get(name, 0)}/{len(reference)}" if batch == "b1" else ""
        print(f"{name:<30}{value:>9.1f}{ratios[0]:>14}{ratios[1]:>17}{ratios[2]:>17}{matching:>15}")


def report(samples: dict[str, list[float]], tokens: dict[str, list[int]], args: argparse.Namespace,
           compile_s: float | None, info: dict[str, Any]) -> None:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    # generate() with min_new_tokens bans EOS, the others pick it when it is the argmax: so
    # compare greedy tokens with our fp32 runner, as the length of the common prefix.
    reference = tokens.get("fast fp32 b1", [])
    same = {name: _common_prefix(t, reference) for name, t in tokens.items()}
    print(f"\n{args.model}: decode tokens/s, median of {args.rounds} interleaved rounds, {args.threads} threads, "
          f"{args.new_tokens} new tokens (b8: aggregate of {args.batch} sequences); CPU kernels: the "
          f"{info['cpu_kernels']} variant; bitsandbytes compute dtype {args.bnb_dtype}")
    _print_table(medians, same, reference)
    bandwidth = medians.get("read GB/s")
    if bandwidth:
        print(f"read bandwidth {bandwidth:.1f} GB/s -> fp32 roofline {bandwidth * 1e9 / info['fp32_weight_bytes']:.1f} "
              f"tok/s ({info['fp32_weight_bytes'] / 1e6:.0f} MB of fp32 weights per token)")
    if compile_s is not None:
        print(f"torch.compile warm-up (per-layer halves, b1 and b{args.batch}, prefill + decode): {compile_s:.1f} s")
    goals = targets(samples, info["fp32_weight_bytes"])
    print("\nTargets (median ratio; range over rounds):")
    for label, goal in goals.items():
        verdict = "" if goal["target"] is None else (" met" if goal["met"] else " NOT met") + f" (>= {goal['target']})"
        spread = f"[{goal['round_min']:.2f} - {goal['round_max']:.2f}]"
        print(f"  {label:<34}{goal['median_ratio']:>6.2f}  {spread}{verdict}")
    name = "runner_decode.json" if args.model == "default" else f"runner_decode_{args.model}.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "settings": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__, **info,
        "medians_tokens_per_s": medians, "samples_tokens_per_s": samples, "targets": goals,
        "compile_warmup_s": compile_s, "greedy_prefix_equal_to_fast_fp32_b1": same, "tokens_b1_row0": tokens,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }, indent=2))
    print(f"wrote {out}")
