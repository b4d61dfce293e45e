"""Environment variables the shard reads, in one typed place, each read once.

ShardEnv is what serving reads; `serve` reads it before the model loads, so a bad value is
refused before minutes of loading. ProcessEnv is what every command reads (serve,
download-weights, build-kernels, layerskip): `process_env()` reads it on first use, which
comes before any model loads, and keeps it for the process.

Upstream's launcher always sets ATTENTION and PREFIX_CACHING; this backend accepts them and
defaults them when started by hand. ATTENTION only sets the Info answer's block_size, the unit
in which a router counts KV blocks (the shard's own pools use blocks of 64 tokens, as upstream's
`flashdecoding-ipex`, the default); PREFIX_CACHING=0 turns off the shard's own prefix cache
(engine/prefix_cache.py; Info.use_prefix_caching), whose size PREFIX_CACHE_MIB sets.
PREFILL_CHUNK_TOKENS: the prompt tokens one step may prefill (a longer prefill runs in chunks
between the running requests' steps; 0: at once, and Info.support_chunking is false).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from .watermark import DEFAULT_DELTA, DEFAULT_GAMMA, WatermarkConfig

T = TypeVar("T")

BLOCK_SIZES = {"paged": 16, "flashdecoding": 256, "flashinfer": 1, "flashdecoding-ipex": 64}


@dataclass(frozen=True)
class ShardEnv:
    attention: str
    prefix_caching: bool
    rank: int
    world_size: int
    watermark: WatermarkConfig = field(default_factory=WatermarkConfig)  # WATERMARK_GAMMA / WATERMARK_DELTA
    prefix_cache_mib: int = 256  # PREFIX_CACHE_MIB: the prefix cache's bytes, in MiB
    prefill_chunk: int = 512  # PREFILL_CHUNK_TOKENS: prompt tokens a step may prefill (0: no chunks)

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> ShardEnv:
        attention = environ.get("ATTENTION", "flashdecoding-ipex")
        if attention not in BLOCK_SIZES:
            raise ValueError(f"ATTENTION={attention!r} is not one of {', '.join(BLOCK_SIZES)}")
        prefix = environ.get("PREFIX_CACHING", "1").lower() in ("1", "true")
        watermark = WatermarkConfig(_float(environ, "WATERMARK_GAMMA", DEFAULT_GAMMA),
                                    _float(environ, "WATERMARK_DELTA", DEFAULT_DELTA))
        mib, chunk = _int(environ, "PREFIX_CACHE_MIB", 256), _int(environ, "PREFILL_CHUNK_TOKENS", 512)
        for name, value in (("PREFIX_CACHE_MIB", mib), ("PREFILL_CHUNK_TOKENS", chunk)):
            if value < 0:
                raise ValueError(f"{name}={value} is negative")
        return cls(attention, prefix, _int(environ, "RANK", 0), _int(environ, "WORLD_SIZE", 1), watermark, mib,
                   chunk)

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.attention]


@dataclass(frozen=True)
class HubEnv:
    """Where download.py looks for checkpoints.

    Attributes:
        cache: the hub cache folder, in huggingface_hub's order: HUGGINGFACE_HUB_CACHE,
            HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub.
        prebuilt: TGI_PREBUILT_HUB_CACHE, a read-only hub cache baked into an image (searched second).
    """

    cache: Path
    prebuilt: Path | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> HubEnv:
        prebuilt = environ.get("TGI_PREBUILT_HUB_CACHE")
        return cls(_hub_cache(environ), Path(prebuilt) if prebuilt else None)


def _hub_cache(environ: Mapping[str, str]) -> Path:
    for var in ("HUGGINGFACE_HUB_CACHE", "HF_HUB_CACHE"):
        if environ.get(var):
            return Path(environ[var])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


@dataclass(frozen=True)
class KernelEnv:
    """How the fast runner's CPU kernels are chosen and built (cpu_kernels.py, kernel_build.py).

    Attributes:
        switch: TGI_CPU_KERNELS: "auto" (default), "off" or a variant name; cpu_kernels.choose
            refuses any other value, naming it.
        folder: TGI_KERNEL_DIR, where built variants live (default ~/.cache/tgi-kernels).
        cxx: CXX, the C++ compiler (default c++).
        quantized_head: TGI_QUANTIZED_LM_HEAD: how a bitsandbytes-quantized model's lm_head (which
            bitsandbytes keeps dense) is read on the kernels: "int8" (default: weight-only int8 in
            blocks, as llama.cpp's Q8_0/Q4_K_M files store their output matrix) or "dense".
        draft_weights: TGI_DRAFT_WEIGHTS: what verified-mode drafts of a dense model read on the
            kernels: "int8" (default: an int8 copy of the decoder layers, made at the first draft)
            or "model" (the model's own weights).
        quantized_activations: TGI_QUANTIZED_ACTIVATIONS: how the kernels multiply a bitsandbytes
            4-bit model: "float" (default: bitsandbytes' numerics, fp32 products of the
            dequantized weights) or "int8" (activations quantized to int8 per 32 values, the code
            table to int8, integer dot products, in the layers and the int8 lm_head, as llama.cpp
            multiplies its blocks: other numerics, about 0.65x the time of a decode step on AVX2).
    """

    switch: str
    folder: Path
    cxx: str
    quantized_head: str = "int8"
    draft_weights: str = "int8"
    quantized_activations: str = "float"

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> KernelEnv:
        folder = Path(environ.get("TGI_KERNEL_DIR") or Path.home() / ".cache" / "tgi-kernels")
        head = environ.get("TGI_QUANTIZED_LM_HEAD", "int8").lower()
        if head not in ("int8", "dense"):
            raise ValueError(f"TGI_QUANTIZED_LM_HEAD={head!r} is not one of int8, dense")
        drafts = environ.get("TGI_DRAFT_WEIGHTS", "int8").lower()
        if drafts not in ("int8", "model"):
            raise ValueError(f"TGI_DRAFT_WEIGHTS={drafts!r} is not one of int8, model")
        activations = environ.get("TGI_QUANTIZED_ACTIVATIONS", "float").lower()
        if activations not in ("float", "int8"):
            raise ValueError(f"TGI_QUANTIZED_ACTIVATIONS={activations!r} is not one of float, int8")
        return cls(environ.get("TGI_CPU_KERNELS", "auto"), folder, environ.get("CXX", "c++"), head, drafts,
                   activations)


@dataclass(frozen=True)
class ProcessEnv:
    """What every command reads. policy_dir: TGI_POLICY_DIR, where `--layer-skip-policy auto`
    looks (None: the repository's policies/, shipped_policies.py)."""

    hub: HubEnv
    kernels: KernelEnv
    policy_dir: Path | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> ProcessEnv:
        policy_dir = environ.get("TGI_POLICY_DIR")
        return cls(HubEnv.read(environ), KernelEnv.read(environ), Path(policy_dir) if policy_dir else None)


@functools.cache
def process_env() -> ProcessEnv:
    """This process's ProcessEnv, read once: later changes to os.environ are not seen."""
    return ProcessEnv.read()


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    return _parsed(environ, name, float, "a number", default)


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    return _parsed(environ, name, int, "an integer", default)


def _parsed(environ: Mapping[str, str], name: str, parse: Callable[[str], T], kind: str, default: T) -> T:
    value = environ.get(name, "")
    if not value:
        return default
    try:
        return parse(value)
    except ValueError as err:
        raise ValueError(f"{name}={value!r} is not {kind}") from err
