"""The fast runner's projections in the CPU kernels' formats (cpu_kernels.Projection).

Design note: fast_weights.read_layer gives each projection as a dense fused weight or as the
bitsandbytes modules it was loaded with. When the kernels run, each becomes one compiled
Projection holding its bias:
- dense fp32/bf16 weights as they are (no copy);
- `Linear4bit` (nf4/fp4): the packed codes and absmax blocks read as bitsandbytes stores them
  (a nested absmax is dequantized once, with bitsandbytes' own function, to the values it
  computes on every call); q/k/v and gate/up are fused by concatenating codes and blocks, which
  is exact when a block never spans two weight rows (k a multiple of the blocksize);
- `Linear8bitLt` (LLM.int8()): CB and SCB as they are, the module's outlier threshold; fusing
  concatenates rows (each row has its own scale; x is quantized the same for every part).
A module the kernels cannot read as it is (4-bit weights already repacked by bitsandbytes for
its AVX-512 BF16 kernel, a compute dtype other than the runner's, fp16 int8 weights, odd
shapes) stays a bitsandbytes module, and that is logged once per model.
"""

from __future__ import annotations

from typing import Any

import torch
from loguru import logger

from ..loading import dtype_name
from .fast_weights import LayerWeights
from .kernel_api import CpuOps, Projection

BNB_4BIT = "Linear4bit"
BNB_8BIT = "Linear8bitLt"


def _bias(modules: tuple[Any, ...], rows: list[int], dtype: torch.dtype) -> torch.Tensor | None:
    biases = [getattr(m, "bias", None) for m in modules]
    if all(b is None for b in biases):
        return None
    parts = [b.detach().to(dtype) if b is not None else torch.zeros(n, dtype=dtype) for b, n in zip(biases, rows,
                                                                                                     strict=True)]
    return torch.cat(parts).contiguous()


def _four_bit_parts(module: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int,
                                                                       int, int] | str:
    """(codes, absmax, table, blocksize, n, k) of a Linear4bit, or why the kernels cannot read it."""
    state = module.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        return "its weights were repacked for bitsandbytes' AVX-512 BF16 kernel"
    compute = getattr(module, "compute_dtype", None)
    if compute not in (None, dtype):
        return f"its compute dtype {compute} is not the runner's {dtype}"
    n, k = (int(d) for d in state.shape)
    if k % 32:  # absmax blocks may span rows (k = 96, blocksize 64): the kernels read them as they lie
        return f"k = {k} is not a multiple of 32"
    absmax = state.absmax
    if state.nested:
        import bitsandbytes.functional as bnb_functional

        absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    table = state.code if state.code is not None and state.code.numel() == 16 else None
    if table is None:
        import bitsandbytes.functional as bnb_functional

        table = bnb_functional.get_4bit_type(state.quant_type, device="cpu")
    codes = module.weight.data.contiguous().view(torch.uint8).reshape(-1)
    return codes, absmax.float().contiguous(), table.float().contiguous(), int(state.blocksize), n, k


def _four_bit(ops: CpuOps, modules: tuple[Any, ...], dtype: torch.dtype, int8_x: bool) -> Projection | str:
    parts = [_four_bit_parts(m, dtype) for m in modules]
    reasons = [p for p in parts if isinstance(p, str)]
    if reasons:
        return reasons[0]
    read = [p for p in parts if not isinstance(p, str)]
    codes, absmax, tables, blocksizes, rows, ks = zip(*read, strict=True)
    if len(set(blocksizes)) > 1 or len(set(ks)) > 1 or any(not torch.equal(t, tables[0]) for t in tables):
        return "its parts differ in blocksize, k or code table"
    return ops.Projection.four_bit(torch.cat(codes), torch.cat(absmax), tables[0], blocksizes[0], sum(rows), ks[0],
                                   _bias(modules, list(rows), dtype), int8_x=int8_x)


def _int8(ops: CpuOps, modules: tuple[Any, ...], dtype: torch.dtype) -> Projection | str:
    codes, scales, thresholds = [], [], []
    for module in modules:
        state = module.state
        if state.has_fp16_weights:
            return "it keeps fp16 weights (has_fp16_weights)"
        cb = state.CB if state.CB is not None else getattr(module.weight, "CB", None)
        scb = state.SCB if state.SCB is not None else getattr(module.weight, "SCB", None)
        cb = module.weight.data if cb is None else cb
        if scb is None or cb.dtype != torch.int8:
            return "its int8 weights (CB/SCB) are not there yet"
        codes.append(cb.contiguous())
        scales.append(scb.float().contiguous())
        thresholds.append(float(state.threshold))
    if len(set(thresholds)) > 1:
        return "its parts have different outlier thresholds"
    return ops.Projection.int8(torch.cat(codes), torch.cat(scales), _bias(modules, [c.shape[0] for c in codes], dtype),
                               thresholds[0])


def weight_kind(layer: LayerWeights, dtype: torch.dtype) -> str:
    """The kernels' weight kind of a layer (kernel_choice.KINDS): its dtype when dense, else the
    bitsandbytes format."""
    qkv = layer.pre[1]
    kinds = set() if isinstance(qkv, torch.Tensor) else {type(m).__name__ for m in qkv or ()}
    if kinds == {BNB_4BIT}:
        return "4bit-bfloat16" if dtype == torch.bfloat16 else "4bit"
    return "int8" if kinds == {BNB_8BIT} else dtype_name(dtype)


def to_projection(ops: CpuOps, weight: Any, bias: torch.Tensor | None, dtype: torch.dtype,
                  refusals: dict[str, str], int8_x: bool = False) -> Any:
    """The kernels' Projection for one fast_weights projection, or it unchanged (reason recorded);
    int8_x: 4-bit weights multiply int8-quantized activations (TGI_QUANTIZED_ACTIVATIONS=int8)."""
    if isinstance(weight, torch.Tensor):
        return ops.Projection.dense(weight, bias)
    kind = {type(m).__name__ for m in weight}
    if kind == {BNB_4BIT}:
        result = _four_bit(ops, weight, dtype, int8_x)
    elif kind == {BNB_8BIT}:
        result = _int8(ops, weight, dtype)
    else:
        result = f"{', '.join(sorted(kind))} has no kernel"
    if isinstance(result, str):
        refusals.setdefault(result, type(weight[0]).__name__)
        return weight
    return result


def _release(modules: tuple[Any, ...]) -> None:
    """Free bitsandbytes modules' codes: their weight's, and LLM.int8()'s CB where it is kept apart."""
    for module in modules:
        module.weight.data = module.weight.data.new_empty(0)
        holders: tuple[Any, ...] = (getattr(module, "state", None), module.weight)
        for holder in holders:
            if getattr(holder, "CB", None) is not None:
                holder.CB = None


def kernel_layer(layer: LayerWeights, ops: CpuOps, dtype: torch.dtype, refusals: dict[str, str],
                 release: bool = False, int8_x: bool = False) -> LayerWeights:
    """The layer with each (projection, bias) pair of pre/post as one kernels' Projection (bias None);
    with `release`, the bitsandbytes modules' codes that the kernels laid out anew are freed;
    int8_x: as to_projection's."""
    norm, qkv, qkv_bias, q_norm, k_norm = layer.pre
    o_proj, o_bias, attn_out_norm, mlp_in_norm, gate_up, gate_up_bias, down, down_bias, mlp_out_norm = layer.post

    def convert(weight: Any, bias: Any) -> tuple[Any, Any]:
        converted = to_projection(ops, weight, bias, dtype, refusals, int8_x)
        if release and converted is not weight and not isinstance(weight, torch.Tensor):
            _release(weight)
        return converted, (bias if converted is weight else None)

    qkv, qkv_bias = convert(qkv, qkv_bias)
    o_proj, o_bias = convert(o_proj, o_bias)
    gate_up, gate_up_bias = convert(gate_up, gate_up_bias)
    down, down_bias = convert(down, down_bias)
    return LayerWeights(pre=(norm, qkv, qkv_bias, q_norm, k_norm),
                        post=(o_proj, o_bias, attn_out_norm, mlp_in_norm, gate_up, gate_up_bias, down, down_bias,
                              mlp_out_norm))


def log_refusals(name: str, refusals: dict[str, str]) -> None:
    for reason, kind in refusals.items():
        logger.warning(f"{name}: some {kind} layers keep bitsandbytes' own product: {reason}")
