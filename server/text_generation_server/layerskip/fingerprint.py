"""Quantization-robust fingerprints of decoder layer weights.

Design note. A policy names layers by what they *are*, not where they sit, so the same
checkpoint must give the same fingerprint in float32, bfloat16, int8 and 4-bit, while two
different layers (or checkpoints) must not. We use a sign random projection (SimHash):

1. For every parameter tensor of a layer (sorted by its name inside the layer, wrapper
   segments removed) take a fixed, deterministic sample of its *logical* flattened values:
   `num_chunks` chunks of 64 contiguous elements whose positions depend only on the logical
   shape and the seed, never on the dtype or the storage. Tensors smaller than the sample are
   taken whole.
2. Dequantize only that sample: bitsandbytes int8 values times their row scale `SCB / 127`;
   packed nf4/fp4 values through their 16-entry code table times their block's absmax (the
   same arithmetic as `bitsandbytes.functional.dequantize_4bit`, which a test checks; calling
   it on whole layers would dequantize every weight); float tensors become float64.
3. Constant tensors (freshly initialized zero biases, all-ones norms) carry no identity and
   would make different layers look alike: they contribute no bits. Quantization keeps a
   constant tensor constant, so copies of one checkpoint still get bit vectors of one length.
4. Centre the sample and project it onto `bits_per_tensor` fixed Gaussian directions; the
   signs are the bits. The bits are invariant to the tensor's scale, and a bit flips with
   probability angle/pi, where angle is the angle between the two samples. Quantization noise
   keeps that angle small (a few percent of bits flip); unrelated weights are near-orthogonal
   (about half the bits differ).

Two fingerprints match when their normalized Hamming distance is at most `max_distance`. Its
default sits near the geometric midpoint between the farthest a quantized copy of a layer
lands from float32 and the nearest two different layers come (tests/layerskip/test_fingerprint.py
prints both; figures in docs/tuning.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

CHUNK = 64  # contiguous elements per sampled chunk (also bitsandbytes' usual 4-bit block size)
FINGERPRINT_SCHEME = "simhash1"


@dataclass(frozen=True)
class FingerprintConfig:
    """How fingerprints are computed and matched.

    Attributes:
        bits_per_tensor: sign bits drawn from each parameter tensor.
        num_chunks: chunks of 64 contiguous values sampled per tensor (4096 values at 64).
        seed: fixes the sample positions and the projection directions.
        max_distance: the largest normalized Hamming distance (0..1) that still matches.
    """

    bits_per_tensor: int = 64
    num_chunks: int = 64
    seed: int = 20251208
    max_distance: float = 0.13

    def __post_init__(self) -> None:
        if not 8 <= self.bits_per_tensor <= 1024 or self.bits_per_tensor % 8:
            raise ValueError(f"bits_per_tensor={self.bits_per_tensor}: use a multiple of 8 in 8..1024")
        if not 1 <= self.num_chunks <= 4096:
            raise ValueError(f"num_chunks={self.num_chunks}: use 1..4096")
        if not 0.0 < self.max_distance < 0.5:
            raise ValueError(
                f"max_distance={self.max_distance}: use a value in (0, 0.5); unrelated weights "
                "differ in about half of their bits, so 0.5 or more would match anything")

    @property
    def tag(self) -> str:
        """The part of a fingerprint string that says how it was computed."""
        return f"{FINGERPRINT_SCHEME}-{self.bits_per_tensor}x{self.num_chunks}-{self.seed}"


def _tensor_seed(seed: int, shape: Sequence[int]) -> int:
    value = seed
    for dim in shape:
        value = (value * 1_000_003 + int(dim)) % (2**63)
    return value


@lru_cache(maxsize=64)
def sample_positions(shape: tuple[int, ...], num_chunks: int, seed: int) -> np.ndarray:
    """Flat logical positions sampled from a tensor of `shape` (sorted, int64)."""
    numel = int(np.prod(shape)) if shape else 1
    if numel <= num_chunks * CHUNK:
        return np.arange(numel, dtype=np.int64)
    rng = np.random.default_rng(_tensor_seed(seed, shape))
    starts = np.sort(rng.choice(numel // CHUNK, size=num_chunks, replace=False)) * CHUNK
    return (starts[:, None] + np.arange(CHUNK)[None, :]).reshape(-1)


@lru_cache(maxsize=64)
def _directions(num_values: int, num_bits: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(_tensor_seed(seed + 1, (num_values, num_bits)))
    return rng.standard_normal((num_bits, num_values))  # [bits, values]


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape a parameter has before quantization (packed 4-bit weights are (n, 1))."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return tuple(int(d) for d in quant_state.shape)
    return tuple(int(d) for d in param.shape)


def _gather(tensor: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """tensor.reshape(-1)[index] as float64 on the CPU (gathered on the tensor's device first)."""
    flat = tensor.detach().reshape(-1)
    return flat.index_select(0, torch.from_numpy(index).to(flat.device)).cpu().double()


def _int8_values(param: torch.Tensor, positions: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    scb = param.SCB  # type: ignore[attr-defined]  # [out] row absmax of an Int8Params
    rows = positions // int(np.prod(shape[1:]))
    result: np.ndarray = (_gather(param.data, positions) * _gather(scb, rows) / 127.0).numpy()
    return result


def _4bit_values(param: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    # Decodes only the sampled values: value = code[nibble] * absmax[block], two values per
    # byte, the first in the high nibble. Calling bitsandbytes.functional.dequantize_4bit per
    # tensor costs a fixed overhead that adds up over a model's tensors; tests check that this
    # decode equals dequantize_4bit on nf4 and fp4 weights.
    import bitsandbytes.functional as bnbf

    state = param.quant_state  # type: ignore[attr-defined]
    absmax = state.absmax
    if state.nested:
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    packed = _gather(param.data.view(torch.uint8), positions // 2).long()
    nibbles = torch.where(torch.from_numpy(positions % 2 == 0), packed >> 4, packed & 0xF)
    code = state.code.detach().cpu().double().index_select(0, nibbles)
    scale = _gather(absmax, positions // int(state.blocksize))
    result: np.ndarray = (code * scale).numpy()
    return result


def sampled_values(param: torch.Tensor, config: FingerprintConfig) -> np.ndarray:
    """The dequantized float64 values of `param` at its fixed sample positions."""
    shape = logical_shape(param)
    positions = sample_positions(shape, config.num_chunks, config.seed)
    with torch.no_grad():
        if getattr(param, "quant_state", None) is not None:
            return _4bit_values(param, positions)
        if getattr(param, "SCB", None) is not None and param.dtype == torch.int8:
            return _int8_values(param, positions, shape)
        result: np.ndarray = _gather(param, positions).numpy()
        return result


def tensor_bits(param: torch.Tensor, config: FingerprintConfig) -> np.ndarray | None:
    """`bits_per_tensor` sign bits (bool) of one parameter tensor; None if it is constant."""
    values = sampled_values(param, config)
    if values.size == 0 or values.max() == values.min():
        return None
    centred = values - values.mean()
    directions = _directions(len(centred), config.bits_per_tensor, config.seed)
    bits: np.ndarray = (directions @ centred) > 0.0
    return bits


def layer_fingerprint(named_params: Sequence[tuple[str, torch.Tensor]], config: FingerprintConfig) -> str:
    """Fingerprint string `<tag>:<hex>` of one layer from its (relative name, parameter) pairs."""
    ordered = sorted(named_params, key=lambda item: item[0])
    parts = [bits for _, param in ordered if (bits := tensor_bits(param, config)) is not None]
    if not parts:
        return f"{config.tag}:"
    return f"{config.tag}:{np.packbits(np.concatenate(parts)).tobytes().hex()}"


def fingerprint_bits(fingerprint: str) -> tuple[str, np.ndarray]:
    """Split a fingerprint string into its tag and its bits (bool array)."""
    tag, sep, hexbits = fingerprint.partition(":")
    if not sep:
        raise ValueError(f"fingerprint {fingerprint[:40]!r} has no '<scheme>:<hex>' form")
    try:
        raw = bytes.fromhex(hexbits)
    except ValueError as err:
        raise ValueError(f"fingerprint {fingerprint[:40]!r}...: bits are not hexadecimal") from err
    return tag, np.unpackbits(np.frombuffer(raw, dtype=np.uint8)).astype(bool)


def distance(a: str, b: str) -> float:
    """Normalized Hamming distance (0..1) between two fingerprints; 1.0 if incomparable."""
    tag_a, bits_a = fingerprint_bits(a)
    tag_b, bits_b = fingerprint_bits(b)
    if tag_a != tag_b or len(bits_a) != len(bits_b) or len(bits_a) == 0:
        return 1.0
    return float(np.count_nonzero(bits_a != bits_b)) / len(bits_a)


def distance_matrix(reference: Sequence[str], loaded: Sequence[str]) -> np.ndarray:
    """[len(reference), len(loaded)] normalized Hamming distances (1.0 where incomparable)."""
    ref = [fingerprint_bits(f) for f in reference]
    got = [fingerprint_bits(f) for f in loaded]
    out = np.ones((len(ref), len(got)))
    for j, (tag_b, bits_b) in enumerate(got):
        for i, (tag_a, bits_a) in enumerate(ref):
            if tag_a == tag_b and len(bits_a) == len(bits_b) and len(bits_a):
                out[i, j] = np.count_nonzero(bits_a != bits_b) / len(bits_a)
    return out
