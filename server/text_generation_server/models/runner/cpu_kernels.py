"""Compiled CPU kernels of the fast runner's decode step, built from source on first use.

Design note: a decode step of a small model on a CPU is the weight stream plus a few hundred
tiny ops. torch runs the products with 1..16 activation rows far below memory bandwidth (bf16
at half of it, 8 rows 2.5x slower than 1), RMSNorm as ~8 ops of ~70 us in all, and SDPA at
~50 us per call. `cpu_kernels.cpp` has one AVX-512 function for each (see its header):
`small_m_linear`, `rms_norm`, `decode_attention`, and `rope` and `silu_mul`, which fold 4-5
small ops each into one call; `decode_layer` composes them into a whole Llama-family layer
for one new token per row, so Python is crossed once per layer. It is compiled with
`torch.utils.cpp_extension` the first time a runner needs it (~40 s on 2 cores; `make install`
and the image build do it ahead with `text-generation-server build-kernels`) into
TGI_KERNEL_DIR (default ~/.cache/tgi-kernels), in a folder named by a hash of the source,
flags, torch and Python versions; a built module is imported from there without a compiler.
It runs on torch's own OpenMP team: compiled with -fopenmp but linked against torch's bundled
libgomp, never the system's, so one thread team serves both.

When the kernels cannot be used, the reason is logged once and the runner uses torch's ops:
the CPU lacks AVX-512 BF16, there is no C++ compiler, or TGI_CPU_KERNELS=off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Protocol

import torch
from loguru import logger

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")
ENV_SWITCH = "TGI_CPU_KERNELS"  # "auto" (default) or "off"
ENV_DIR = "TGI_KERNEL_DIR"
NAME = "tgi_cpu_kernels"
MAX_ROWS = 16  # kMaxRows in the C++ source
DTYPES = (torch.float32, torch.bfloat16)


class CpuOps(Protocol):
    """The compiled module's functions (float32 and bfloat16; errors name the bad argument)."""

    max_rows: int

    def small_m_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, /) -> torch.Tensor:
        """`x [m, k] @ weight[n, k].T (+ bias)` for 1 <= m <= max_rows, both contiguous."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, /) -> torch.Tensor:
        """transformers' RMSNorm over the last dimension of a contiguous x."""

    def decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         scale: float, /) -> torch.Tensor:
        """q `[rows, 1, heads, dim]` against keys/values `[rows, kv, total, dim]` -> `[rows, 1, heads * dim]`."""

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, /) -> torch.Tensor:
        """rope.apply_rope of x `[rows, new, heads, dim]` (a view is fine), returned contiguous."""

    def silu_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor:
        """silu(gate) * up of a contiguous fused `[..., 2 * inner]` gate/up output."""

    def decode_layer(self, h: torch.Tensor, in_norm: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None,
                     o_proj: torch.Tensor, o_bias: torch.Tensor | None, mlp_norm: torch.Tensor,
                     gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
                     down_bias: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int,
                     cos: torch.Tensor, sin_signed: torch.Tensor, mask: torch.Tensor, heads: int, kv_heads: int,
                     eps: float, scale: float, /) -> torch.Tensor:
        """A Llama-family decoder layer for h `[rows, 1, hidden]`; writes cache column `length`."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used on this machine, or None when it can be built."""
    switch = os.environ.get(ENV_SWITCH, "auto").lower()
    if switch not in ("auto", "off"):
        raise ValueError(f"{ENV_SWITCH}={switch!r} is not one of auto, off")
    if switch == "off":
        return f"{ENV_SWITCH}=off"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the CPU is {platform.machine()}, the kernel is written for x86-64 AVX-512"
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


@functools.cache
def load() -> CpuOps | None:
    """The compiled kernels, or None when they cannot be used here (the reason is logged once)."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return build()
        except Exception as error:  # noqa: BLE001 - any build failure means "use torch", said loudly
            reason = f"building {SOURCE.name} failed: {str(error).strip().splitlines()[-1] if str(error) else error!r}"
    logger.warning(f"CPU kernels unavailable ({reason}): the fast runner uses torch's ops, which are slower")
    return None


def _flags() -> tuple[list[str], list[str]]:
    torch_lib = Path(torch.__file__).parent / "lib"
    cflags = ["-O3", "-fopenmp", "-ffp-contract=off", *(f"-m{flag.replace('_', '')}" for flag in REQUIRED_CPU_FLAGS)]
    # torch's libgomp (same soname as the one torch loaded): one OpenMP runtime, one team.
    ldflags = [f"-L{torch_lib}", "-lgomp", f"-Wl,-rpath,{torch_lib}"]
    return cflags, ldflags


def build_dir() -> Path:
    """Where this source, built with these flags for this torch and Python, lives."""
    cflags, ldflags = _flags()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *cflags, *ldflags, torch.__version__, sys.version])
                         .encode()).hexdigest()[:16]
    root = Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "tgi-kernels")
    return root / f"{NAME}-{key}"


def build() -> CpuOps:
    """The compiled module: imported when built before, else compiled now (any CPU can compile it)."""
    folder = build_dir()
    built = folder / f"{NAME}.so"  # cpp_extension's name for it
    # Built before (or baked into an image): no compiler needed. cpp_extension holds `lock`
    # while a build runs; then the call below waits for that build and loads its result.
    if built.exists() and not (folder / "lock").exists():
        spec = importlib.util.spec_from_file_location(NAME, built)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ops: CpuOps = module
        return ops
    from torch.utils.cpp_extension import load as compile_and_load

    folder.mkdir(parents=True, exist_ok=True)
    logger.info(f"Compiling {SOURCE.name} into {folder} (once; ~40 s on 2 cores)")
    cflags, ldflags = _flags()
    built_module: CpuOps = compile_and_load(name=NAME, sources=[str(SOURCE)], extra_cflags=cflags,
                                            extra_ldflags=ldflags, build_directory=str(folder), verbose=False)
    return built_module


def linear_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether small_m_linear takes this product (rows of x, dtypes, CPU tensors)."""
    return (x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype == weight.dtype and x.dtype in DTYPES
            and weight.device.type == "cpu" and weight.is_contiguous())
