"""Which of the runnable kernel variants is fastest on this CPU, per weight kind: measured once.

Design note: the widest ISA the flags allow is not always the fastest (a CPU that executes
AVX-512 as two 256-bit halves can run avx2 faster, and the winner differs per weight kind:
docs/tuning.md). So, as FFTW keeps "wisdom", the variant for `TGI_CPU_KERNELS=auto` is chosen
by timing each runnable variant on a synthetic decode step of that weight kind (decoder layers
of one shape whose weights exceed the last-level cache, one new token for 1 and for 8 rows,
interleaved rounds in alternating order, medians; only variants whose code for that kind
differs, cpu_kernels.variants_for: timing identical code against itself measures the machine's
noise, and the choice would flip from one build to the next; the score is the mean of each row
count's time relative to the fastest variant's: LLM.int8() on avx2 ties at one row and loses
at eight, where VNNI's dot products count) and remembered in `choices.json` in the build
folder, keyed by the CPU model, its flags and METHOD.
`build-kernels` measures every kind at install time, so every process on a machine reads the
same choice (the numerics of variants differ in the order of fp32 sums, and two processes of
one server must agree); a process whose CPU has no entry (an image built on another host)
measures the kind it needs once, under the build folder's lock, and writes it when the folder
is writable. A variant must be 3% faster than a wider one to be chosen, so that noise does not
flip the choice.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from loguru import logger

from . import kernel_build
from .kernel_api import CpuOps, Projection
from .kv_cache import BLOCK_SIZE

# weight formats of the fast runner's projections (4bit: bitsandbytes 4-bit with an fp32 compute dtype;
# 4bit-bfloat16: with bf16, which the avx512_bf16 variant multiplies with its bf16 dot product and the amx
# variant on tiles; 4bit-int8x: with int8 activations, TGI_QUANTIZED_ACTIVATIONS=int8, whose integer products
# run on VNNI's vpdpbusd and AMX's int8 tiles)
KINDS = ("float32", "bfloat16", "4bit", "4bit-bfloat16", "4bit-int8x", "int8")
EXTENSIONS = ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")  # CPU flags beyond AVX-512F
EXTENSIONS_USED = {"float32": (), "bfloat16": ("avx512_bf16", "amx_tile", "amx_bf16"), "4bit": (),
                   "4bit-bfloat16": ("avx512_bf16", "amx_tile", "amx_bf16"),
                   "4bit-int8x": ("avx512_vnni", "amx_tile", "amx_int8"),
                   "int8": ("avx512_vnni", "amx_tile", "amx_int8")}  # what each kind's kernels use (variants_for)
CHOICES_FILE = "choices.json"
MARGIN = 0.97  # a narrower variant must take at most this share of a wider one's time
WEIGHT_BYTES = 96 << 20  # weights per synthetic step: beyond the last-level cache of these machines
HIDDEN, INTER, HEADS, KV_HEADS, DIM, CONTEXT = 576, 1536, 9, 3, 64, 64
BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "4bit": 0.5625, "4bit-bfloat16": 0.5625, "4bit-int8x": 0.5625,
                    "int8": 1.0}
NF4_LIKE = torch.linspace(-1.0, 1.0, 16)
ROWS = (1, 8)  # batch sizes of the synthetic steps
# part of the key: a new method measures again
METHOD = "synthetic decode steps of 1 and 8 rows, variants distinct per kind"


def cpu_signature(flags: set[str], model_name: str) -> str:
    interesting = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
    return f"{model_name} | {' '.join(interesting)} | {METHOD}"


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


class _Layer(NamedTuple):
    norm: torch.Tensor
    qkv: Projection
    o_proj: Projection
    gate_up: Projection
    down: Projection


class _SyntheticStep:
    """Decoder layers of one weight kind on one variant's kernels, and one decode step over them."""

    def __init__(self, ops: CpuOps, kind: str, num_layers: int, seed: int) -> None:
        self.ops, self.kind = ops, kind
        generator = torch.Generator().manual_seed(seed)
        self.dtype = torch.bfloat16 if kind in ("bfloat16", "4bit-bfloat16") else torch.float32
        shapes = {"qkv": ((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), "o": (HIDDEN, HEADS * DIM),
                  "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
        norm = torch.ones(HIDDEN, dtype=self.dtype)
        self.layers = [_Layer(norm, *(self._projection(n, k, generator) for n, k in shapes.values()))
                       for _ in range(num_layers)]
        rows = max(ROWS)
        blocks = -(-rows * (CONTEXT + 1) // BLOCK_SIZE)
        self.keys = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, DIM, generator=generator).to(self.dtype)
        self.values = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, DIM, generator=generator).to(self.dtype)
        self.slots = torch.arange(rows * (CONTEXT + 1)).view(rows, CONTEXT + 1)  # each row's own columns
        self.cos = torch.ones(rows, 1, 1, DIM, dtype=self.dtype)
        self.sin = torch.zeros(rows, 1, 1, DIM, dtype=self.dtype)
        self.mask = torch.zeros(rows, 1, 1, CONTEXT + 1, dtype=self.dtype)
        self.h = torch.randn(rows, 1, HIDDEN, generator=generator).to(self.dtype) * 0.1

    def _projection(self, n: int, k: int, generator: torch.Generator) -> Projection:
        factory = self.ops.Projection
        if self.kind.startswith("4bit"):
            codes = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=generator)
            return factory.four_bit(codes, torch.full((n * k // 64,), 0.05), NF4_LIKE, 64, n, k, None,
                                    int8_x=self.kind == "4bit-int8x")
        if self.kind == "int8":
            codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
            return factory.int8(codes, torch.full((n,), 0.05), None, 6.0)
        return factory.dense((torch.randn(n, k, generator=generator) / k**0.5).to(self.dtype), None)

    def __call__(self, rows: int) -> None:
        h = self.h[:rows]
        slots, cos, sin, mask = (t[:rows] for t in (self.slots, self.cos, self.sin, self.mask))
        for layer in self.layers:
            h = self.ops.decode_layer(h, layer.norm, layer.qkv, layer.o_proj, layer.norm, layer.gate_up, layer.down,
                                      self.keys, self.values, slots, cos, sin, mask, HEADS, KV_HEADS, 1e-5,
                                      DIM**-0.5)


def measure(modules: dict[str, CpuOps], kind: str, rounds: int = 4, steps: int = 5) -> dict[str, dict[int, float]]:
    """Median seconds of a synthetic decode step of `kind` per variant and row count (interleaved)."""
    layer_weights = (HIDDEN * (HEADS + 2 * KV_HEADS) * DIM + HEADS * DIM * HIDDEN + 3 * INTER * HIDDEN)
    num_layers = max(1, int(WEIGHT_BYTES / (layer_weights * BYTES_PER_WEIGHT[kind])))
    stepper = {name: _SyntheticStep(ops, kind, num_layers, seed=7) for name, ops in modules.items()}
    samples: dict[str, dict[int, list[float]]] = {name: {rows: [] for rows in ROWS} for name in stepper}
    for step in stepper.values():  # first-call allocations
        for rows in ROWS:
            step(rows)
    for round_ in range(rounds):  # each round in the other order: a drift of the machine favours none
        for name, step in list(stepper.items())[:: 1 if round_ % 2 == 0 else -1]:
            for rows in ROWS:
                for _ in range(steps):
                    start = time.perf_counter()
                    step(rows)
                    samples[name][rows].append(time.perf_counter() - start)
    return {name: {rows: statistics.median(values) for rows, values in by_rows.items()}
            for name, by_rows in samples.items()}


def scores(timings: dict[str, dict[int, float]]) -> dict[str, float]:
    """Per variant, the mean over row counts of its time relative to the fastest variant's (1.0: fastest at all)."""
    fastest = {rows: min(t[rows] for t in timings.values()) for rows in ROWS}
    return {name: statistics.mean(t[rows] / fastest[rows] for rows in ROWS) for name, t in timings.items()}


def pick(score: dict[str, float], widest_first: list[str]) -> str:
    """The lowest score, where a narrower variant must beat every wider one by MARGIN."""
    best = widest_first[0]
    for name in widest_first[1:]:
        if score[name] <= MARGIN * score[best]:
            best = name
    return best


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def choose(folder: Path, signature: str, kind: str, loaders: Mapping[str, Callable[[], CpuOps]]) -> tuple[str, str]:
    """(variant, how it was chosen) for `kind` among `loaders` (runnable variants, widest first)."""
    names = list(loaders)
    if len(names) == 1:
        return names[0], "the only variant this CPU runs"
    path = folder / CHOICES_FILE
    remembered = _read(path).get(signature, {}).get(kind)
    if isinstance(remembered, dict) and remembered.get("variant") in names:
        return remembered["variant"], _describe(remembered, "measured at install")
    modules = {name: load() for name, load in loaders.items()}  # built (under the lock) before taking it
    with _lock_if_possible(folder):
        remembered = _read(path).get(signature, {}).get(kind)  # another process may have measured it
        if isinstance(remembered, dict) and remembered.get("variant") in names:
            return remembered["variant"], _describe(remembered, "measured at install")
        timings = measure(modules, kind)
        score = scores(timings)
        variant = pick(score, names)
        ms = {name: {str(rows): round(seconds * 1e3, 3) for rows, seconds in by_rows.items()}
              for name, by_rows in timings.items()}
        entry = {"variant": variant, "score": score, "ms": ms, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        data = _read(path)
        data.setdefault(signature, {})[kind] = entry
        try:
            path.write_text(json.dumps(data, indent=1) + "\n")
        except OSError as error:
            logger.warning(f"CPU kernels: cannot remember the measured choice in {path} ({error}); "
                           "each process measures again")
    return variant, _describe(entry, "measured now")


def _lock_if_possible(folder: Path) -> contextlib.AbstractContextManager[object]:
    """The build folder's lock, or none where it cannot be taken (an image's read-only folder)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{folder.name}.lock", "a"):
            pass
    except OSError:
        return contextlib.nullcontext()
    return kernel_build.locked(folder)


def _describe(entry: dict[str, Any], when: str) -> str:
    """e.g. 'fastest on synthetic decode steps (1 / 8 rows), measured now: avx2 4.1 / 9.8 ms, ...'"""
    ms = entry.get("ms", {})
    parts = ", ".join(f"{name} {' / '.join(f'{float(v):.1f}' for v in by_rows.values())} ms"
                      for name, by_rows in ms.items() if isinstance(by_rows, dict))
    rows = " / ".join(str(r) for r in ROWS)
    return f"fastest on synthetic decode steps ({rows} rows), {when}: {parts}" if parts else f"fastest, {when}"
