"""A decode step's products alone: our kernels against torch's and bitsandbytes' own ops.

Random weights with the default model's layer shapes (30 layers of fused q/k/v, o, gate/up and
down projections: 120 products, 106M weights; the lm_head is left out), or the Qwen 0.5B's (24
layers, 358M weights), 1 and 8 activation rows (or `--rows`), 2 threads. Contestants, per weight format:
- fp32 / bf16: torch `F.linear` vs our `small_m_linear`;
- int8: our LLM.int8() kernel vs `bnb.matmul` (what Linear8bitLt runs; the same numerics) vs
  torch's weight-only `_weight_int8pack_mm` (other numerics: no activation quantization);
- 4-bit: our nf4 kernel vs bitsandbytes' CPU path (dequantize the weight, then F.linear; the same
  numerics) vs our kernel with int8 activations ("kernel int8-x", TGI_QUANTIZED_ACTIVATIONS=int8: other
  numerics) vs torch's `_weight_int4pack_mm_for_cpu` (asymmetric int4 with zero points in groups
  of 64: it cannot hold nf4's table, so it is a speed reference only);
- 4-bit with a bf16 compute dtype ("nf4-bf16"): our kernel (bf16 dot products on the
  avx512_bf16 variant) vs bitsandbytes' path in bf16 (weights dequantized, cast to bf16, F.linear).
Each format runs on the variant chosen for its weight kind (kernel_choice).
Each figure is one whole step of products; contestants are interleaved, median of the repeats.
Results: benchmark/results/kernel_products.json (or --out NAME).

Usage: .venv/bin/python benchmark/kernel_products.py [--repeats 7] [--threads 2]
       [--shapes smollm2-135m|qwen0.5b] [--formats fp32,bf16,int8,nf4,nf4-bf16] [--rows 1,8] [--out NAME]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from text_generation_server.models.runner import cpu_kernels

from common import interleave, summarize, write_results

# (out, in) of one decoder layer's fused products (q/k/v, o, gate/up, down), and the layer count.
SHAPES = {"smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
          "qwen0.5b": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24)}
GROUP = 64

Product = Callable[[torch.Tensor], torch.Tensor]  # x -> y for one weight


def _weights(shapes: list[tuple[int, int]], layers: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) / shape[1] ** 0.5 for _ in range(layers) for shape in shapes]


def dense(ops: cpu_kernels.CpuOps, weights: list[torch.Tensor], dtype: torch.dtype) -> dict[str, list[Product]]:
    cast = [w.to(dtype) for w in weights]
    return {"torch": [lambda x, w=w: F.linear(x, w) for w in cast],  # type: ignore[misc]
            "kernel": [lambda x, w=w: ops.small_m_linear(x, w, None) for w in cast]}  # type: ignore[misc]


def int8(ops: cpu_kernels.CpuOps, weights: list[torch.Tensor]) -> dict[str, list[Product]]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    out: dict[str, list[Product]] = {"kernel": [], "bnb.matmul": [], "torch int8pack": []}
    for w in weights:
        codes, scales, _ = bnb_functional.int8_vectorwise_quant(w.half())
        state = bnb.MatmulLtState()
        state.CB, state.SCB, state.threshold = codes, scales, 6.0
        state.has_fp16_weights = state.is_training = False
        projection = ops.Projection.int8(codes, scales, None, 6.0)
        out["kernel"].append(projection)
        out["bnb.matmul"].append(lambda x, c=codes, s=state: bnb.matmul(x, c, state=s))
        weight_scales = scales / 127.0
        out["torch int8pack"].append(lambda x, c=codes, s=weight_scales: torch._weight_int8pack_mm(x, c, s))
    return out


def four_bit(ops: cpu_kernels.CpuOps, weights: list[torch.Tensor],
             dtype: torch.dtype = torch.float32) -> dict[str, list[Product]]:
    import bitsandbytes.functional as bnb_functional

    table = bnb_functional.get_4bit_type("nf4", device="cpu").float()
    out: dict[str, list[Product]] = {"kernel": [], "bnb dequantize+linear": []}
    if dtype == torch.float32:
        out["kernel int8-x"] = []
        out["torch int4pack"] = []
    for w in weights:
        n, k = w.shape
        packed, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
        out["kernel"].append(ops.Projection.four_bit(packed.view(torch.uint8).reshape(-1), state.absmax.float(),
                                                     table, 64, n, k, None))
        out["bnb dequantize+linear"].append(
            lambda x, p=packed, s=state: F.linear(x, bnb_functional.dequantize_4bit(p, s).to(x.dtype)))
        if dtype != torch.float32:
            continue
        out["kernel int8-x"].append(ops.Projection.four_bit(packed.view(torch.uint8).reshape(-1), state.absmax.float(),
                                                            table, 64, n, k, None, int8_x=True))
        groups = w.view(n, k // GROUP, GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-8) / 15
        codes = torch.clamp(torch.round((groups - low) / scale), 0, 15).to(torch.int32).view(n, k)
        int4 = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        zeros = low + 8 * scale  # torch's convention: w = (code - 8) * scale + zero
        scales_zeros = torch.stack([scale.view(n, -1).T, zeros.view(n, -1).T], dim=-1).contiguous()
        out["torch int4pack"].append(
            lambda x, q=int4, sz=scales_zeros: torch._weight_int4pack_mm_for_cpu(x, q, GROUP, sz))
    return out


def step_timer(products: list[Product], weights: list[torch.Tensor], dtype: torch.dtype,
               rows: int) -> Callable[[], float]:
    keys = [w.shape[1] for w in weights]
    inputs = {k: torch.randn(rows, k).to(dtype) for k in set(keys)}

    def run() -> float:
        start = time.perf_counter()
        for product, k in zip(products, keys, strict=True):
            product(inputs[k])
        return (time.perf_counter() - start) * 1e3

    run()  # first touch
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m", help="whose layer shapes")
    parser.add_argument("--formats", default="fp32,bf16,int8,nf4,nf4-bf16")
    parser.add_argument("--rows", default="1,8", help="activation rows, comma-separated")
    parser.add_argument("--out", default="kernel_products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its "inputs will be cast" on every int8 call
    loaded = {kind: cpu_kernels.load(kind=kind) for kind in ("float32", "bfloat16", "int8", "4bit", "4bit-bfloat16")}
    ops = {kind: o for kind, o in loaded.items() if o is not None}
    if len(ops) < len(loaded):
        raise SystemExit(f"the CPU kernels are unavailable here: {cpu_kernels.unavailable_reason()}")
    weights = _weights(*SHAPES[args.shapes])
    params = sum(w.numel() for w in weights)
    builders = {"fp32": (lambda: dense(ops["float32"], weights, torch.float32), torch.float32, 4.0),
                "bf16": (lambda: dense(ops["bfloat16"], weights, torch.bfloat16), torch.bfloat16, 2.0),
                "int8": (lambda: int8(ops["int8"], weights), torch.float32, 1.0),
                "nf4": (lambda: four_bit(ops["4bit"], weights), torch.float32, 0.5625),
                "nf4-bf16": (lambda: four_bit(ops["4bit-bfloat16"], weights, torch.bfloat16), torch.bfloat16, 0.5625)}
    unknown = sorted(set(args.formats.split(",")) - set(builders))
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown}; known: {sorted(builders)}")
    formats = {fmt: (build(), dtype, width) for fmt, (build, dtype, width) in builders.items()
               if fmt in args.formats.split(",")}
    row_counts = [int(rows) for rows in args.rows.split(",")]
    runs = {f"{fmt} {name} {rows} row{'s' if rows > 1 else ''}": step_timer(products, weights, dtype, rows)
            for fmt, (contestants, dtype, _) in formats.items() for rows in row_counts
            for name, products in contestants.items()}
    figures = summarize(interleave(runs, args.repeats))
    variants = {kind: o.variant for kind, o in ops.items()}
    print(f"\nOne decode step's layer products ({params / 1e6:.0f}M weights; ms, median of {args.repeats}); "
          f"GB/s = weight bytes / time; CPU kernels: {variants}")
    for name, figure in figures.items():
        gb_s = params * formats[name.split()[0]][2] / figure["median"] / 1e6
        figure["weight_gb_per_s"] = gb_s
        one_row = figures.get(name.rsplit(" ", 2)[0] + " 1 row")  # the same contestant's 1-row time
        if one_row:
            figure["over_1_row"] = figure["median"] / one_row["median"]
        print(f"{name:<36}{figure['median']:>8.1f} ms{gb_s:>8.1f} GB/s"
              + (f"{figure['over_1_row']:>7.2f}x 1 row" if one_row else ""))
    write_results(args.out, {"threads": args.threads, "repeats": args.repeats, "shapes": args.shapes,
                             "cpu_kernels": variants, "ms_per_step": figures})


if __name__ == "__main__":
    main()
