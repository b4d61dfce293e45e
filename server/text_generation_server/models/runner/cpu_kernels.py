"""Compiled CPU kernels of the fast runner, in ISA variants chosen at run time.

Design note: a decode step of a small model on a CPU is the weight stream plus a few hundred
tiny ops. torch runs the products with 1..16 activation rows far below memory bandwidth (and
slower with every row), RMSNorm as ~8 ops, SDPA with a fixed cost per call, and
bitsandbytes' 4-bit and int8 products as a dequantization of the whole weight before each
matmul. `cpu_kernels.cpp` and `kernels/*.cpp` have one function for each: weight-streaming
products (fp32, bf16, bitsandbytes 4-bit and LLM.int8()), `rms_norm`, `decode_attention` (a few
new queries per row), `rope`, `silu_mul`, and `decode_layer`, a whole Llama-family layer for a
few new tokens per row, so Python is crossed once per layer.

Variants, as ggml and ATen do it: the kernels are compiled once per ISA level (VARIANTS, widest
first) and one the CPU's flags allow is imported per weight kind (float32, bfloat16, 4-bit in
fp32 or bf16 or with int8 activations, int8): the one measured fastest for that kind on this CPU (kernel_choice.py: the
widest is not always the fastest), once per process; the log and the shard's Info name it. fp32 kernels
never use a bf16 instruction (bf16 weights are widened by shifts below avx512_bf16), and int8
products use AVX-512 VNNI where the CPU has it. Building
(`text-generation-server build-kernels`, run by `make install` and the image build; kernel_build.py)
compiles every variant and imports none, so a build never executes an instruction the CPU lacks.
Modules live in TGI_KERNEL_DIR (default ~/.cache/tgi-kernels), in a folder named by a hash of
the sources, flags, torch and Python versions, and are imported from there without a compiler.
They run on torch's own OpenMP team: linked against torch's bundled libgomp, never the system's.

TGI_CPU_KERNELS: "auto" (default: the measured choice), "off" (torch's ops), or a variant name to
force it (tests run the avx2 variant on AVX-512 machines this way). When the kernels cannot be
used (another ISA, a forced variant the CPU lacks, no compiler), the reason is logged once and
the runner uses torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from ...env import process_env
from . import kernel_build, kernel_choice
from .kernel_api import CpuOps

SOURCE = kernel_build.BINDINGS
ENV_SWITCH = "TGI_CPU_KERNELS"  # "auto" (default), "off", or a variant name (env.KernelEnv.switch)
NAME = kernel_build.NAME
MAX_ROWS = 16  # kMaxRows in kernels/kernels.h
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Variant:
    """One ISA level: the /proc/cpuinfo flags it needs and the compiler flags it is built with."""

    name: str
    cpu_flags: tuple[str, ...]

    @property
    def compiler_flags(self) -> tuple[str, ...]:
        # GCC spells AVX-512's extensions without their underscore, AMX's with a hyphen
        return tuple(f"-m{flag.replace('_', '-' if flag.startswith('amx') else '')}" for flag in self.cpu_flags)


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
_AVX512_BF16 = (*_AVX512, "avx512_vnni", "avx512_bf16")
VARIANTS = (  # best first
    # bf16 and LLM.int8() products on AMX tiles (kernels/amx.h)
    Variant("amx", (*_AVX512_BF16, "amx_tile", "amx_bf16", "amx_int8")),
    Variant("avx512_bf16", _AVX512_BF16),
    Variant("avx512_vnni", (*_AVX512, "avx512_vnni")),
    Variant("avx512", _AVX512),
    Variant("avx2", _AVX2),
)
BY_NAME = {variant.name: variant for variant in VARIANTS}


def cpu_flags() -> set[str]:
    """This CPU's flags from /proc/cpuinfo (empty where there is none), less AMX's when the OS does
    not grant this process the tile data (amx_permitted)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return flags if amx_permitted() else {flag for flag in flags if not flag.startswith("amx")}
    return set()


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX's tile data, asking for it (arch_prctl
    ARCH_REQ_XCOMP_PERM, once per process, for every thread; Linux >= 5.16). Without the grant a
    tile instruction kills the process (SIGILL), so the amx variants count as missing their flags."""
    if platform.machine() != "x86_64" or sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # SYS_arch_prctl, <asm/prctl.h>
    args = (ctypes.c_long(arch_prctl), ctypes.c_long(req_xcomp_perm), ctypes.c_long(xfeature_xtiledata))
    return libc.syscall(*args) == 0  # syscall(2) reads longs


def choose(switch: str, flags: set[str], machine: str) -> Variant | str:
    """The variant to use for switch value `switch` on a CPU with `flags`, or why none is used."""
    switch = switch.lower()
    if switch not in ("auto", "off", *BY_NAME):
        raise ValueError(f"{ENV_SWITCH}={switch!r} is not one of auto, off, {', '.join(BY_NAME)}")
    if switch == "off":
        return f"{ENV_SWITCH}=off"
    if machine not in ("x86_64", "AMD64"):
        return f"the CPU is {machine}, the kernels are written for x86-64 (AVX2 or AVX-512)"
    if switch != "auto":
        missing = [flag for flag in BY_NAME[switch].cpu_flags if flag not in flags]
        return f"{ENV_SWITCH}={switch} but the CPU lacks {', '.join(missing)}" if missing else BY_NAME[switch]
    for variant in VARIANTS:
        if all(flag in flags for flag in variant.cpu_flags):
            return variant
    missing = [flag for flag in VARIANTS[-1].cpu_flags if flag not in flags]
    return f"the CPU lacks {', '.join(missing)} (the least the kernels need: AVX2, FMA, F16C)"


def _switch(switch: str | None) -> str:
    return process_env().kernels.switch if switch is None else switch


def chosen(switch: str | None = None) -> Variant | str:
    """The variant for a TGI_CPU_KERNELS value (default: this process's) on this CPU, or why none;
    for `auto` the widest one the flags allow (load() then takes the one measured fastest)."""
    return choose(_switch(switch), cpu_flags(), platform.machine())


def unavailable_reason(switch: str | None = None) -> str | None:
    """Why the kernels cannot be used here, or None when a variant can be built and run."""
    choice = chosen(switch)
    return choice if isinstance(choice, str) else None


def runnable_variants() -> list[Variant]:
    """Every variant this CPU can run and the compiler could build (tests exercise each of them)."""
    if platform.machine() != "x86_64":
        return []
    flags, folder = cpu_flags(), build_dir()
    return [v for v in VARIANTS
            if all(f in flags for f in v.cpu_flags) and kernel_build.unsupported(folder, v.name) is None]


def variants_for(kind: str, variants: list[Variant]) -> list[Variant]:
    """Of `variants` (widest first), those whose code for weights of `kind` differs: a variant's
    extension that the kind's kernels do not use (kernel_choice.EXTENSIONS) compiles the same code
    as the next narrower variant, which is kept (fp32 products run the same AVX-512F code in the
    avx512_bf16, avx512_vnni and avx512 variants: timing them against each other measured noise,
    and the choice flipped between builds)."""
    unused = set(kernel_choice.EXTENSIONS) - set(kernel_choice.EXTENSIONS_USED[kind])
    kept: dict[frozenset[str], Variant] = {}
    for variant in variants:
        kept[frozenset(variant.cpu_flags) - unused] = variant  # the narrowest of equal ones stays
    return [v for v in variants if v in kept.values()]


def build_dir() -> Path:
    """Where these sources, built with these flags for this torch and Python, live."""
    parts = [path.read_text() for path in kernel_build.sources() if path != kernel_build.BINDINGS]
    parts += [SOURCE.read_text(), *kernel_build.common_flags(), *kernel_build.link_flags(), torch.__version__,
              sys.version, *(f"{v.name}:{' '.join(v.compiler_flags)}" for v in VARIANTS)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return process_env().kernels.folder / f"{NAME}-{key}"


def build(variants: tuple[Variant, ...] = VARIANTS) -> Path:
    """Compile the variants not built yet (every one by default: compiling runs none of them); one
    whose flags the compiler does not take is skipped, saying why (the others still serve)."""
    folder = build_dir()
    missing = [v for v in variants if not kernel_build.module_path(folder, v.name).exists()]
    if missing:
        logger.info(f"Compiling the CPU kernels ({', '.join(v.name for v in missing)}) into {folder} (once)")
        kernel_build.build(folder, {v.name: v.compiler_flags for v in missing})
        for variant in missing:
            reason = kernel_build.unsupported(folder, variant.name)
            if reason:
                logger.warning(f"The {variant.name} variant of the CPU kernels is not built: {reason}")
    return folder


def built_variants() -> list[Variant]:
    """The variants compiled in this build folder (build() skips those the compiler cannot build)."""
    folder = build_dir()
    return [v for v in VARIANTS if kernel_build.module_path(folder, v.name).exists()]


@functools.cache
def load_variant(name: str) -> CpuOps:
    """Import one variant's module, compiling it first when it is not built. The caller makes sure
    the CPU can run it (importing a variant the CPU lacks may end the process: SIGILL)."""
    folder = build((BY_NAME[name],))
    reason = kernel_build.unsupported(folder, name)
    if reason:
        raise RuntimeError(f"the {name} variant is not built: {reason}")
    path = kernel_build.module_path(folder, name)
    spec = importlib.util.spec_from_file_location(kernel_build.module_name(name), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ops: CpuOps = module  # type: ignore[assignment]
    assert ops.variant == name, f"{path} holds the {ops.variant} variant, not {name}"
    return ops


@functools.cache
def _load(switch: str, kind: str) -> CpuOps | None:
    choice = choose(switch, cpu_flags(), platform.machine())
    if isinstance(choice, str):
        reason = choice
    else:
        try:
            name, why = choice.name, f"forced by {ENV_SWITCH}"
            if switch == "auto":
                candidates = {v.name: functools.partial(load_variant, v.name)
                              for v in variants_for(kind, runnable_variants())}
                signature = kernel_choice.cpu_signature(cpu_flags(), kernel_choice.cpu_model_name())
                name, why = kernel_choice.choose(build_dir(), signature, kind, candidates)
            ops = load_variant(name)
            logger.info(f"CPU kernels for {kind} weights: the {name} variant ({', '.join(BY_NAME[name].cpu_flags)}; "
                        f"{why})")
            return ops
        except Exception as error:  # noqa: BLE001 - any build failure means "use torch", said loudly
            last = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            reason = f"building {SOURCE.name} failed: {last}"
    logger.warning(f"CPU kernels unavailable ({reason}): the fast runner uses torch's ops, which are slower")
    return None


def load(switch: str | None = None, kind: str = "float32") -> CpuOps | None:
    """The kernels for weights of `kind` (kernel_choice.KINDS) that a TGI_CPU_KERNELS value (default:
    this process's) and the CPU choose, or None (the reason is logged once). `auto` takes the variant
    measured fastest for that kind on this CPU (kernel_choice.py); a variant name forces it."""
    if kind not in kernel_choice.KINDS:
        raise ValueError(f"kernel weight kind {kind!r} is not one of {', '.join(kernel_choice.KINDS)}")
    return _load(_switch(switch).lower(), kind)


def linear_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether small_m_linear takes this product (rows of x, dtypes, CPU tensors)."""
    return (x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype == weight.dtype and x.dtype in DTYPES
            and weight.device.type == "cpu" and weight.is_contiguous())
