"""The decode step's products alone: torch's `F.linear` against our `small_m_linear` kernel.

Random weights with the default model's shapes (30 layers of fused q/k/v, o, gate/up and down
projections, plus the 49152-row lm_head: 121 products, 538 MB in fp32), 1 and 8 activation
rows, fp32 and bf16, 2 threads. Each figure is one whole step of products; contestants are
interleaved, median of the repeats. Results: benchmark/results/kernel_products.json.

Usage: .venv/bin/python benchmark/kernel_products.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from text_generation_server.models.runner import cpu_kernels

from common import interleave, summarize, write_results

# (out, in) of one decoder layer's fused products; the lm_head is added once.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
LM_HEAD = (49152, 576)

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def step_timer(dtype: torch.dtype, rows: int, product: Product) -> Callable[[], float]:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator).to(dtype) for _ in range(LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(LM_HEAD, generator=generator).to(dtype))
    inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in {w.shape[1] for w in weights}}

    def run() -> float:
        start = time.perf_counter()
        for weight in weights:
            product(inputs[weight.shape[1]], weight)
        return (time.perf_counter() - start) * 1e3

    run()  # first touch
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_kernels.load()
    if ops is None:
        raise SystemExit(f"the CPU kernels are unavailable here: {cpu_kernels.unavailable_reason()}")
    contestants: dict[str, Product] = {"torch": lambda x, w: F.linear(x, w),
                                       "kernel": lambda x, w: ops.small_m_linear(x, w, None)}
    runs = {f"{name} {str(dtype).removeprefix('torch.')} {rows} row{'s' if rows > 1 else ''}":
            step_timer(dtype, rows, product)
            for dtype in (torch.float32, torch.bfloat16) for rows in (1, 8) for name, product in contestants.items()}
    figures = summarize(interleave(runs, args.repeats))
    bytes_per_weight = {torch.float32: 4, torch.bfloat16: 2}
    params = LAYERS * sum(o * i for o, i in LAYER_SHAPES) + LM_HEAD[0] * LM_HEAD[1]
    print(f"\nOne decode step's products (ms, median of {args.repeats}); GB/s = weight bytes / time")
    for name, figure in figures.items():
        dtype = torch.float32 if "float32" in name else torch.bfloat16
        gb_s = params * bytes_per_weight[dtype] / figure["median"] / 1e6
        figure["weight_gb_per_s"] = gb_s
        print(f"{name:<26}{figure['median']:>8.1f} ms{gb_s:>8.1f} GB/s")
    write_results("kernel_products", {"threads": args.threads, "repeats": args.repeats, "ms_per_step": figures})


if __name__ == "__main__":
    main()
