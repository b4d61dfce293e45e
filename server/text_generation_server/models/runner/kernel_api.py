"""The compiled CPU kernels' interface, as the runner and the variant chooser see it (cpu_kernels.cpp)."""

from __future__ import annotations

from typing import Protocol

import torch


class Projection(Protocol):
    """A weight in one of the kernels' formats with its bias (cpu_kernels.cpp: Projection)."""

    n: int
    k: int
    nbytes: int  # what one product reads: weights (codes), scales or absmax blocks, bias
    tensors: list[torch.Tensor]  # the tensors it holds (memory accounting)

    def __call__(self, x: torch.Tensor, /, exact: bool = False) -> torch.Tensor:
        """x `[m, k]` -> `[m, n]` (1..16 rows on the kernels; more in chunks of 16 on the kernels
        for quantized weights, dense ones up to 64 fp32 / 32 bf16 rows or any number with `exact`,
        else on torch's GEMM)."""


class ProjectionFactory(Protocol):
    def dense(self, weight: torch.Tensor, bias: torch.Tensor | None, /) -> Projection: ...

    def four_bit(self, codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, blocksize: int, n: int, k: int,
                 bias: torch.Tensor | None, /, int8_x: bool = False) -> Projection:
        """bitsandbytes' 4-bit layout; int8_x: x quantized to int8 per 32 values and multiplied in
        integers (TGI_QUANTIZED_ACTIVATIONS=int8) instead of bitsandbytes' fp32 products."""

    def int8(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, threshold: float,
             /) -> Projection: ...

    def int8_weights(self, codes: torch.Tensor, scales: torch.Tensor, blocksize: int, bias: torch.Tensor | None,
                     /, int8_x: bool = False) -> Projection:
        """Weight-only int8 in blocks; int8_x: x quantized to int8 per 32 values (as four_bit's)."""


_Projection = Projection  # the Protocol below has a member of that name


class CpuOps(Protocol):
    """The compiled module's functions (float32 and bfloat16; errors name the bad argument)."""

    max_rows: int
    variant: str
    Projection: ProjectionFactory

    def small_m_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, /) -> torch.Tensor:
        """`x [m, k] @ weight[n, k].T (+ bias)` for 1 <= m <= max_rows, both contiguous."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, /) -> torch.Tensor:
        """transformers' RMSNorm over the last dimension of a contiguous x."""

    def decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         scale: float, slots: torch.Tensor | None = None) -> torch.Tensor:
        """q `[rows, new, heads, dim]` against keys/values `[rows, kv, total, dim]`, or with `slots`
        `[rows, total]` against a paged cache's keys/values `[blocks, kv, block_size, dim]`
        -> `[rows, new, heads * dim]`."""

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, /) -> torch.Tensor:
        """rope.apply_rope of x `[rows, new, heads, dim]` (a view is fine), returned contiguous."""

    def silu_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor:
        """silu(gate) * up of a contiguous fused `[..., 2 * inner]` gate/up output."""

    def decode_layer(self, h: torch.Tensor, in_norm: torch.Tensor, qkv: _Projection, o_proj: _Projection,
                     mlp_norm: torch.Tensor, gate_up: _Projection, down: _Projection, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     mask: torch.Tensor, heads: int, kv_heads: int, eps: float, scale: float, /) -> torch.Tensor:
        """A Llama-family decoder layer for h `[rows, new, hidden]` over a paged cache (`KVCache`):
        reads the columns of `slots` `[rows, length + new]`, writes the new keys and values to its last `new`."""
