"""Compiled CPU kernels of the fast runner, built from source on first use.

Design note: the decode step's matrix products have 1..16 rows of activations against a whole
weight matrix; torch's CPU GEMMs run them far below memory bandwidth (bf16 at half of it, 8
rows 2.5x slower than 1). `small_m_linear.cpp` is an AVX-512 kernel for exactly that case
(fp32 FMA, bf16 pair dot products with fp32 accumulation). It is compiled with
`torch.utils.cpp_extension` the first time a runner needs it (~40 s on 2 cores; `make
install` and the image build do it ahead with `text-generation-server build-kernels`) into TGI_KERNEL_DIR (default
~/.cache/tgi-kernels), in a folder named by a hash of the source, flags, torch and Python
versions; a built module is imported from there without a compiler. It runs on torch's own
OpenMP team: compiled with -fopenmp but linked against torch's bundled libgomp, never the
system's, so one thread team serves both.

When the kernel cannot be used, the reason is logged once and every product goes to torch:
the CPU lacks AVX-512 BF16, there is no C++ compiler, or TGI_CPU_KERNELS=off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from loguru import logger

SOURCE = Path(__file__).with_name("small_m_linear.cpp")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")
ENV_SWITCH = "TGI_CPU_KERNELS"  # "auto" (default) or "off"
ENV_DIR = "TGI_KERNEL_DIR"
NAME = "tgi_small_m_linear"
MAX_ROWS = 16  # kMaxRows in the C++ source
DTYPES = (torch.float32, torch.bfloat16)

SmallMLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


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
def small_m_linear() -> SmallMLinear | None:
    """`f(x [m, k], weight [n, k], bias [n] | None) -> [m, n]` for m <= 16, or None (reason logged)."""
    reason = unavailable_reason()
    if reason is None:
        try:
            module = build()
        except Exception as error:  # noqa: BLE001 - any build failure means "use torch", said loudly
            reason = f"building {SOURCE.name} failed: {str(error).strip().splitlines()[-1] if str(error) else error!r}"
        else:
            function: SmallMLinear = module.small_m_linear
            return function
    logger.warning(f"CPU kernel unavailable ({reason}): small matrix products use torch, which is slower")
    return None


def _flags() -> tuple[list[str], list[str]]:
    torch_lib = Path(torch.__file__).parent / "lib"
    cflags = ["-O3", "-fopenmp", *(f"-m{flag.replace('_', '')}" for flag in REQUIRED_CPU_FLAGS)]
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


def build() -> Any:
    """The compiled module: imported when built before, else compiled now (any CPU can compile it)."""
    folder = build_dir()
    built = folder / f"{NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if not built.exists():
        built = folder / f"{NAME}.so"  # cpp_extension's name for it
    if built.exists():  # built before (or baked into an image): no compiler needed
        spec = importlib.util.spec_from_file_location(NAME, built)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils.cpp_extension import load

    folder.mkdir(parents=True, exist_ok=True)
    logger.info(f"Compiling {SOURCE.name} into {folder} (once; ~40 s on 2 cores)")
    cflags, ldflags = _flags()
    return load(name=NAME, sources=[str(SOURCE)], extra_cflags=cflags, extra_ldflags=ldflags,
                build_directory=str(folder), verbose=False)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this product (rows of x, dtypes, CPU tensors)."""
    return (x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype == weight.dtype and x.dtype in DTYPES
            and weight.device.type == "cpu" and weight.is_contiguous())
