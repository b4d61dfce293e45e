"""Prefill (time to the first token) of our fast runner against llama.cpp, in one run.

A user who quantizes expects long prompts to get faster, not slower. Each contestant prefills one
prompt of `--lengths` tokens (a slice of one code-like text, the same ids on both sides) and
picks the first token greedily; the timed span is that whole call. Contestants as in
runner_decode.py: the fast runner in fp32 and bf16 (dense products of more than 16 rows in chunks
on the kernels up to 64 rows in fp32, else on torch's GEMM) and with bitsandbytes nf4 and int8
weights (compute dtype `--bnb-dtype`; 4-bit products in chunks of 16 rows on the kernels,
LLM.int8() on its own kernel at any row count),
against llama.cpp's f32, f16, Q4_K_M and Q8_0 GGUFs of the same weights (llamacpp_decode.py with
one new token, a subprocess per round). Every round runs every contestant at every length
(interleaved); the table shows medians and the ratio to the llama.cpp counterpart (> 1: ours is
faster). Results: benchmark/results/prefill[_<model>].json.

    .venv/bin/python benchmark/prefill.py [--model qwen0.5b] [--bnb-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from runner_decode import MODELS, llamacpp_round, make_ggufs, runner_generate

from text_generation_server.download import download_weights
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.models.runner import FastLlamaRunner, FastRunnerConfig, Runner

from common import write_results

PAIRS = {"fp32": "f32", "bf16": "f16", "nf4": "q4_k_m", "int8": "q8_0"}  # ours -> llama.cpp's counterpart


def runners(path: Path, bnb_dtype: str) -> dict[str, Runner]:
    model = load_model(path, LoadConfig())
    out: dict[str, Runner] = {"fp32": FastLlamaRunner(model),
                              "bf16": FastLlamaRunner(model, FastRunnerConfig(dtype=torch.bfloat16))}
    for label, quantize in (("nf4", "bitsandbytes-nf4"), ("int8", "bitsandbytes")):
        out[label] = FastLlamaRunner(load_model(path, LoadConfig(quantize=quantize, dtype=bnb_dtype)))
    return out


def prompt_ids(path: Path, longest: int) -> list[int]:
    """`longest` token ids of this repository's runner_decode.py, repeated as needed."""
    tokenizer = load_tokenizer(path)
    ids: list[int] = tokenizer((Path(__file__).parent / "runner_decode.py").read_text())["input_ids"]
    return (ids * (longest // len(ids) + 1))[:longest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--lengths", default="16,64,256,1024", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bnb-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if any(n < 1 for n in lengths):
        parser.error(f"--lengths {args.lengths}: every length must be at least 1 token")
    torch.set_num_threads(args.threads)
    path = download_weights(MODELS[args.model])
    ids = prompt_ids(path, max(lengths))
    ours = runners(path, args.bnb_dtype)
    for runner in ours.values():  # first-call allocations, oneDNN kernel selection
        runner_generate(runner, [ids[: min(lengths)]], 1)
    ggufs = {} if args.no_llamacpp else {
        name: gguf for name, gguf in make_ggufs(args.model).items() if name in PAIRS.values()}
    seconds: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        for n in lengths:
            for label, runner in ours.items():
                start = time.perf_counter()
                runner_generate(runner, [ids[:n]], 1)
                seconds.setdefault(f"{label} {n}", []).append(time.perf_counter() - start)
            if ggufs:
                result = llamacpp_round(ggufs, [ids[:n]], 1, args.threads)  # 1 new token: tokens/s = 1 / seconds
                for name in ggufs:
                    seconds.setdefault(f"llama.cpp {name} {n}", []).append(1.0 / float(result[name]))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    rows = []
    print(f"\nprefill, {args.model}, bnb compute dtype {args.bnb_dtype}: median ms (prompt tokens/s); "
          "ratio = llama.cpp's time / ours")
    for n in lengths:
        for label, gguf in PAIRS.items():
            ours_s, theirs_s = medians[f"{label} {n}"], medians.get(f"llama.cpp {gguf} {n}")
            ratio = theirs_s / ours_s if theirs_s else None
            rows.append({"tokens": n, "ours": label, "llama.cpp": gguf, "ours_ms": ours_s * 1e3,
                         "llama.cpp_ms": theirs_s * 1e3 if theirs_s else None, "ratio": ratio})
            against = f"llama.cpp {gguf} {theirs_s * 1e3:8.1f} ms  ratio {ratio:.2f}x" if theirs_s else ""
            print(f"  {n:5d} tokens  {label:5s} {ours_s * 1e3:8.1f} ms ({n / ours_s:7.1f} tok/s)   {against}")
    suffix = "" if args.model == "default" else f"_{args.model}"
    suffix += "_bnb_bf16" if args.bnb_dtype == "bfloat16" else ""
    write_results(args.out or f"prefill{suffix}", {
        "args": vars(args), "threads": args.threads, "rows": rows,
        "seconds": {key: {"median": medians[key], "runs": values} for key, values in seconds.items()}})


if __name__ == "__main__":
    main()
