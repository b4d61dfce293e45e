"""Fast runner for the Llama family (Llama, Mistral, Qwen2, SmolLM) and Gemma 3.

Design note: on a 2-core CPU an eager transformers step of a 135M model is bound by per-op
overhead, not arithmetic. This runner keeps the math of transformers' modules but issues
fewer, larger ops:
- q/k/v and gate/up are one matmul each (fused weights, see fast_weights.py);
- RoPE cos/sin come from tables built once and gathered once per forward; q and k rotate in
  one op; the mask is built once per forward and shared by every layer;
- attention is `F.scaled_dot_product_attention` with grouped kv heads (no repeat_kv copy),
  reading the shared `KVCache` whose append writes in place;
- logits are computed only for the positions asked for (a small model's tied lm_head is a
  large share of its weights);
- on x86-64 with AVX2 or AVX-512, compiled kernels (cpu_kernels.py, the variant the CPU runs)
  take the hot spots of forwards with at most 16 activation rows (rows x new tokens: decode
  steps up to batch 16, draft verification, short prefills): the products stream the weights
  once for all rows (fp32, bf16, and bitsandbytes' int8 and 4-bit layouts read as they are,
  kernel_weights.py), where torch's GEMM falls well short of the bandwidth in bf16 and slows
  down with every row in fp32 and bitsandbytes dequantizes every weight per call; RMSNorm,
  RoPE and silu(gate) * up are one call each; attention of the new tokens against the cache
  replaces SDPA's CPU kernel (a fixed cost per call), also beyond 16 activation rows while a row
  brings at most 16 new tokens (every verification: its result does not depend on the batch,
  so verified mode's greedy tokens are off's bit for bit). For the Llama family such a forward runs each
  decoder layer as one compiled call, `decode_layer`, built of the same pieces: Python is
  crossed once per layer instead of once per op.
The layer loop stays in Python, so `skip_layers` is a plain `continue` and an optional
`torch.compile` of the two per-layer halves (`pre_attention`, `post_attention`) never
recompiles for a new skip plan: every layer shares the same compiled graphs, with its own
weights passed as arguments. The cache append and attention stay eager between the halves
because their sizes grow every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from loguru import logger

from ...env import process_env
from ..loading import CheckpointTensor, MappedEmbedding, deferred_table
from . import cpu_kernels
from .base import ForwardInputs, LayerPath, Runner, score_positions
from .fast_weights import ArchSpec, LayerWeights, Projection, norm_weight, read_layer, read_spec, rope_sources
from .kernel_api import CpuOps
from .kernel_api import Projection as KernelProjection
from .kernel_weights import kernel_layer, log_refusals, weight_kind
from .kv_cache import KVCache
from .rope import RopeTable, apply_rope


@dataclass(frozen=True)
class FastRunnerConfig:
    """How to build the fast runner.

    Attributes:
        dtype: compute dtype; None keeps the loaded model's (float32 or bfloat16). A different
            dtype copies the weights (used by benchmarks to load once and compare dtypes).
        compile: torch.compile the two halves of a decoder layer (inductor; needs a C
            compiler). The first forward of each shape class compiles (see README-runner).
        kernels: use the compiled CPU kernels where the CPU has them (cpu_kernels.py: the best
            ISA variant it runs); False keeps every op in torch (benchmarks compare both). Not
            combined with compile, whose graphs call torch.
        kernel_switch: a TGI_CPU_KERNELS value for this runner alone (tests and benchmarks force
            the avx2 variant on AVX-512 CPUs this way); None takes the process's.
        int8_head: read the lm_head as weight-only int8 (absmax scales per block of 64 weights,
            llama.cpp's Q8_0 idea; quantized here from the loaded weights) on the kernels: 1.06
            bytes per weight instead of 4 (fp32) or 2 (bf16), at the cost of that rounding in
            every logit (measured in README-runner.md). None (default): on for bitsandbytes
            models (whose lm_head bitsandbytes keeps dense: most of a quantized step's bytes)
            unless TGI_QUANTIZED_LM_HEAD=dense, off for dense models (their logits stay the model's).
        draft_weights: what verified-mode draft forwards (`forward(draft=True)`) of a dense
            Llama-family model read on the kernels: "int8" (an int8 copy of each decoder layer's
            projections in LLM.int8()'s format and of the draft's head as int8_head's blocks, made
            at its first draft, `_int8_drafts`, `_int8_head`) or "model"; None takes
            TGI_DRAFT_WEIGHTS (default int8).
            Verification always reads the model's own weights, so the tokens do not change, only
            how many drafts are accepted.
        quantized_activations: how a bitsandbytes 4-bit model's products run on the kernels:
            "float" (bitsandbytes' numerics) or "int8" (activations quantized to int8 per 32
            values, the code table to int8, integer dot products, the int8 lm_head's too:
            quantized.cpp); None takes TGI_QUANTIZED_ACTIVATIONS (default float).
        release_model: free each bitsandbytes layer's codes in the model once the kernels have
            their own layout of them, so that the two never exist whole at once (1.5B nf4: 703
            MiB); the model's decoder layers cannot run afterwards (for a server that drops it).
    """

    dtype: torch.dtype | None = None
    compile: bool = False
    kernels: bool = True
    kernel_switch: str | None = None
    int8_head: bool | None = None
    draft_weights: str | None = None
    quantized_activations: str | None = None
    release_model: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"fast runner dtype {self.dtype} is not supported; use float32 or bfloat16")
        if self.draft_weights not in (None, "int8", "model"):
            raise ValueError(f"draft_weights {self.draft_weights!r} is not one of int8, model")
        if self.quantized_activations not in (None, "float", "int8"):
            raise ValueError(f"quantized_activations {self.quantized_activations!r} is not one of float, int8")


@dataclass(frozen=True)
class Dims:
    """The constants the per-layer functions need (same object for every layer)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    gelu: bool
    ops: CpuOps | None = None
    # torch's bf16 GEMM is native here (avx512_bf16 or AMX); without it (AVX2 CPUs) it is several
    # times slower than the kernels in chunks, which then take dense bf16 products of any size
    bf16_gemm: bool = True


def linear(x: torch.Tensor, weight: Projection | KernelProjection, bias: torch.Tensor | None,
           dims: Dims, exact: bool = False) -> torch.Tensor:
    """x `[rows, new, k]` @ weight. `exact` (decode steps and verifications, whatever the batch):
    dense products of any row count take the kernels in chunks, so a row's result is the one-row
    product's and a verification equals its steps. Otherwise (prefills) many rows may take torch's
    GEMM where it is faster."""
    if isinstance(weight, torch.Tensor):
        if dims.ops is not None and cpu_kernels.linear_usable(x, weight):
            out = dims.ops.small_m_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)
            return out.view(*x.shape[:-1], weight.shape[0])
        if dims.ops is not None and x.dtype == weight.dtype and x.dtype in cpu_kernels.DTYPES:
            # more rows (a verification of 17+ activation rows, a prefill's logits): the kernels in chunks
            out = dims.ops.Projection.dense(weight, bias)(x.reshape(-1, x.shape[-1]), _chunked(x, dims, exact))
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    if not isinstance(weight, tuple):  # the kernels' Projection (kernel_weights.py): holds its bias
        return weight(x.reshape(-1, x.shape[-1]), _chunked(x, dims, exact)).view(*x.shape[:-1], weight.n)
    if len(weight) == 1:  # bitsandbytes module: keeps its own bias and dtype handling
        return weight[0](x).to(x.dtype)
    return torch.cat([module(x) for module in weight], dim=-1).to(x.dtype)


def _chunked(x: torch.Tensor, dims: Dims, exact: bool) -> bool:
    """Whether a kernel product of many rows runs in chunks on the kernels (else torch's GEMM)."""
    return exact or (x.dtype == torch.bfloat16 and not dims.bf16_gemm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, dims: Dims) -> torch.Tensor:
    if dims.ops is not None and x.is_contiguous():
        return dims.ops.rms_norm(x, weight, dims.eps)
    return F.rms_norm(x, (x.shape[-1],), weight, dims.eps)


def pre_attention(
    h: torch.Tensor,  # [rows, new, hidden]
    cos: torch.Tensor,  # [rows, new, 1, head_dim]
    sin: torch.Tensor,  # [rows, new, 1, head_dim], first half negated
    norm: torch.Tensor,
    qkv: Projection,
    qkv_bias: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    dims: Dims,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, fused q/k/v projection, (Gemma q/k norms), RoPE.

    Returns q `[rows, new, heads, head_dim]`, k and v `[rows, new, kv_heads, head_dim]`.
    """
    rows, new, _ = h.shape
    num_qk = dims.num_heads + dims.num_kv_heads
    qkv_out = linear(rms_norm(h, norm, dims), qkv, qkv_bias, dims, exact)
    qkv_out = qkv_out.view(rows, new, num_qk + dims.num_kv_heads, dims.head_dim)
    qk, v = qkv_out[:, :, :num_qk], qkv_out[:, :, num_qk:]
    if q_norm is not None and k_norm is not None:
        q = rms_norm(qk[:, :, : dims.num_heads], q_norm, dims)
        k = rms_norm(qk[:, :, dims.num_heads :], k_norm, dims)
        qk = torch.cat((q, k), dim=2)
    if dims.ops is not None:
        qk = dims.ops.rope(qk, cos, sin)
    else:
        qk = apply_rope(qk, cos, sin)  # [rows, new, heads + kv_heads, head_dim]
    return qk[:, :, : dims.num_heads], qk[:, :, dims.num_heads :], v


def post_attention(
    h: torch.Tensor,  # [rows, new, hidden] (the layer input: residual stream)
    attn: torch.Tensor,  # [rows, new, heads * head_dim]
    o_proj: Projection,
    o_bias: torch.Tensor | None,
    attn_out_norm: torch.Tensor | None,
    mlp_in_norm: torch.Tensor,
    gate_up: Projection,
    gate_up_bias: torch.Tensor | None,
    down: Projection,
    down_bias: torch.Tensor | None,
    mlp_out_norm: torch.Tensor | None,
    dims: Dims,
    exact: bool = False,
) -> torch.Tensor:
    """Output projection + residual, then the gated MLP + residual. Returns `[rows, new, hidden]`."""
    out = linear(attn, o_proj, o_bias, dims, exact)
    if attn_out_norm is not None:
        out = rms_norm(out, attn_out_norm, dims)
    h = h + out
    gate_up_out = linear(rms_norm(h, mlp_in_norm, dims), gate_up, gate_up_bias, dims, exact)
    if dims.ops is not None and not dims.gelu:
        act_up = dims.ops.silu_mul(gate_up_out)
    else:
        gate, up = gate_up_out.chunk(2, dim=-1)
        act_up = (F.gelu(gate, approximate="tanh") if dims.gelu else F.silu(gate)) * up
    out = linear(act_up, down, down_bias, dims, exact)
    if mlp_out_norm is not None:
        out = rms_norm(out, mlp_out_norm, dims)
    return h + out


class FusedLayer(NamedTuple):
    """A Llama-family layer in cpu_kernels' decode_layer argument order (kernels' Projections)."""

    in_norm: torch.Tensor
    qkv: KernelProjection
    o_proj: KernelProjection
    mlp_norm: torch.Tensor
    gate_up: KernelProjection
    down: KernelProjection

    @classmethod
    def of(cls, layer: LayerWeights) -> FusedLayer | None:
        """The layer's arguments, or None when a projection kept bitsandbytes' own product."""
        norm, qkv, _, _, _ = layer.pre
        o_proj, _, _, mlp_norm, gate_up, _, down, _, _ = layer.post
        if any(isinstance(p, (torch.Tensor, tuple)) for p in (qkv, o_proj, gate_up, down)):
            return None
        return cls(_dense(norm), qkv, o_proj, _dense(mlp_norm), gate_up, down)  # type: ignore[arg-type]


def _dense(weight: object) -> torch.Tensor:
    assert isinstance(weight, torch.Tensor), f"decode_layer needs dense weights, got {type(weight).__name__}"
    return weight


def additive_mask(attention_mask: torch.Tensor, new: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """`[rows, 1, new, total]` additive mask: causal over columns, padding, optional window.

    Masked entries get the dtype's minimum rather than -inf, so that a padding query row,
    which sees no key at all, gets a uniform softmax instead of NaNs that would leak into the
    cache through V.
    """
    total = attention_mask.shape[1]
    query_cols = torch.arange(total - new, total)[:, None]  # [new, 1]
    key_cols = torch.arange(total)[None, :]  # [1, total]
    allowed = key_cols <= query_cols
    if window is not None:
        allowed = allowed & (query_cols - key_cols < window)
    allowed = allowed[None, None] & attention_mask[:, None, None, :].bool()  # [rows, 1, new, total]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)


class FastLlamaRunner(Runner):
    """Runner for Llama-family and Gemma 3 models (see module docstring)."""

    def __init__(self, model: Any, config: FastRunnerConfig = FastRunnerConfig()) -> None:
        self.spec: ArchSpec = read_spec(model)
        self.config = config
        self.dtype: torch.dtype = config.dtype or _model_dtype(model)
        self.device = torch.device("cpu")
        self.name = f"fast-{self.spec.family}"
        self.num_layers = self.spec.num_layers
        self.vocab_size = self.spec.vocab_size
        self.layers: list[LayerWeights] = [read_layer(layer, self.spec, self.dtype) for layer in model.model.layers]
        dense_layers = self.layers
        # The kernels take float32 and bfloat16 (dense or bitsandbytes); decided here once, not per op.
        use_kernels = config.kernels and not config.compile and self.dtype in cpu_kernels.DTYPES
        kind = weight_kind(self.layers[0], self.dtype)
        activations = config.quantized_activations or process_env().kernels.quantized_activations
        if kind == "4bit" and activations == "int8":
            kind = "4bit-int8x"
        bitsandbytes = kind.startswith("4bit") or kind == "int8"  # else dense weights in self.dtype
        ops = cpu_kernels.load(config.kernel_switch, kind) if use_kernels else None
        self.cpu_kernels = ops.variant if ops is not None else "none"
        self.quantized_activations = activations if kind.startswith("4bit") and ops is not None else None
        if ops is not None:
            refusals: dict[str, str] = {}
            int8_x = self.quantized_activations == "int8"
            self.layers = [kernel_layer(lw, ops, self.dtype, refusals, config.release_model, int8_x)
                           for lw in self.layers]
            log_refusals(self.name, refusals)
        if self.quantized_activations == "int8":
            logger.info(f"{self.name}: 4-bit and int8 lm_head products quantize activations to int8 per 32 "
                        "values (TGI_QUANTIZED_ACTIVATIONS=int8: llama.cpp's numerics, not bitsandbytes')")
        self.dims = Dims(self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim,
                         self.spec.rms_norm_eps, self.spec.activation == "gelu_tanh", ops,
                         bf16_gemm=bool(cpu_kernels.cpu_flags() & {"avx512_bf16", "amx_bf16"}))
        logger.info(f"{self.name}: decode hot spots run on "
                    f"{f'the {ops.variant} CPU kernels' if ops is not None else 'torch'}")
        # Decode steps and short multi-token forwards of the Llama family run each layer as one
        # compiled call (decode_layer); its arguments are gathered here once. Gemma 3's extra
        # norms and GELU stay in Python (on the same kernels).
        self._fused_layers = ([FusedLayer.of(lw) for lw in self.layers]
                              if ops is not None and self.spec.family == "llama" else None)
        drafts = config.draft_weights or process_env().kernels.draft_weights
        int8_drafts = (drafts == "int8" and self._fused_layers is not None and not bitsandbytes
                       and all(f is not None for f in self._fused_layers))
        self.draft_weights = "int8" if int8_drafts else "model"
        self._dense_layers = dense_layers if int8_drafts else None  # quantized at the first draft
        self._draft_layers: tuple[CpuOps, list[FusedLayer]] | None = None
        self._draft_heads: dict[tuple[int, int], tuple[torch.Tensor, KernelProjection]] = {}
        # [vocab, hidden]; None where lookups read the checkpoint (a deferred table: loading.py)
        embed_source = deferred_table(model, model.model.embed_tokens.weight)
        self.embed: torch.Tensor | None = (model.model.embed_tokens.weight.detach().to(self.dtype)
                                           if embed_source is None else None)
        self._lookup = MappedEmbedding(embed_source, self.dtype) if embed_source is not None else None
        head_source = deferred_table(model, model.lm_head.weight)
        head = model.lm_head.weight.detach().to(self.dtype) if head_source is None else head_source
        quantized = bitsandbytes and process_env().kernels.quantized_head == "int8"
        wants_int8 = config.int8_head if config.int8_head is not None else quantized
        self.int8_lm_head = (int8_head(ops, head, self.quantized_activations == "int8")
                             if ops is not None and wants_int8 else None)
        self.head_projection = self.int8_lm_head[:] if self.int8_lm_head is not None else None
        # tied: the same tensor as embed; None where it is read as int8 (one copy of the head)
        self.lm_head: torch.Tensor | None = None
        if self.int8_lm_head is None:
            self.lm_head = head.read(self.dtype) if isinstance(head, CheckpointTensor) else head
        else:
            logger.info(f"{self.name}: the lm_head is read as weight-only int8 (blocks of {INT8_HEAD_BLOCK}; "
                        "TGI_QUANTIZED_LM_HEAD=dense keeps it dense); draft heads are its rows")
        self.final_norm = read_final_norm(model, self.spec, self.dtype)
        self.embed_scale = (torch.tensor(self.spec.embed_scale).to(self.dtype)
                            if self.spec.embed_scale is not None else None)
        self.ropes = {key: RopeTable(inv_freq, scaling, self.dtype)
                      for key, (inv_freq, scaling) in rope_sources(model, self.spec).items()}
        self._pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = pre_attention
        self._post: Callable[..., torch.Tensor] = post_attention
        if config.compile:
            self._compile()

    def memory_parts(self) -> dict[str, Any]:
        # "runner": what else it holds (rope tables; the unfused dense layers kept for int8 drafts)
        return {"embeddings": self.embed, "lm_head": [self.lm_head, self.int8_lm_head],
                "layers": [self.layers, self._fused_layers, self.final_norm],
                "drafts": [self._draft_layers, self._draft_heads], "runner": self}

    def checkpoint_embeddings(self) -> torch.nn.Module | None:
        return self._lookup

    def head_rows(self, ids: torch.Tensor) -> Int8Head | torch.Tensor:
        if self.int8_lm_head is not None:
            return self.int8_lm_head.take(ids)
        assert self.lm_head is not None
        return self.lm_head.index_select(0, ids).contiguous()

    def _dense(self) -> bool:
        """Whether every projection is a plain weight (no bitsandbytes modules)."""
        return all(isinstance(w, torch.Tensor) for w in (*self.layers[0].pre, *self.layers[0].post) if w is not None)

    def _compile(self) -> None:
        if not self._dense():
            raise ValueError("--runner-compile does not support bitsandbytes layers; run without it")
        self._pre = torch.compile(pre_attention, dynamic=True)
        self._post = torch.compile(post_attention, dynamic=True)

    def _hidden(self, inputs: ForwardInputs, cache: KVCache, path: LayerPath) -> tuple[torch.Tensor, bool]:
        """The decoder layers along `path`: hidden states `[rows, new, hidden]` before the final
        norm, and whether the products were exact (a decode step or verification)."""
        input_ids, position_ids, attention_mask = inputs.input_ids, inputs.position_ids, inputs.attention_mask
        rows, new = input_ids.shape
        expected = (rows, cache.length + new)
        assert attention_mask.shape == expected, f"attention_mask {tuple(attention_mask.shape)} != {expected}"
        h = self._lookup(input_ids) if self._lookup is not None else F.embedding(input_ids, _dense(self.embed))
        h = h.to(self.dtype)  # [rows, new, hidden]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        max_position = cache.length + new  # bounds position_ids without reading them
        ropes = {key: table.gather(position_ids, max_position) for key, table in self.ropes.items()}
        masks: dict[int | None, torch.Tensor] = {
            window: additive_mask(attention_mask, new, window, self.dtype) for window in set(self.spec.sliding_windows)}
        # A decode step or a verification (new tokens after a cache): products exact whatever the batch.
        exact = cache.length > 0 and new <= cpu_kernels.MAX_ROWS
        for i, layer in enumerate(self.layers):
            if i in path.skip:  # bypass: the hidden state passes through, no cache for it
                if path.biases and i in path.biases:  # graceful: add the mean residual update
                    h = h + path.biases[i].to(h.dtype)
                continue
            cos, sin = ropes[self.spec.rope_keys[i]]
            h = self._layer(i, layer, h, cos, sin, masks[self.spec.sliding_windows[i]], cache, path.draft, exact)
        cache.advance(new)
        return h, exact

    @torch.inference_mode()
    def run(self, inputs: ForwardInputs, cache: KVCache, path: LayerPath) -> torch.Tensor:
        h, exact = self._hidden(inputs, cache, path)
        if inputs.last_only:
            h = h[:, -1:]
        return self._logits(h, path.head, path.draft, exact)

    @torch.inference_mode()
    def run_scored(self, inputs: ForwardInputs, cache: KVCache, path: LayerPath,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the head runs a block of positions at a time: a long prompt's [rows, new, vocab] logits
        # (gigabytes over a large vocabulary, e.g. the router's warm-up batch) never exist at once
        h, exact = self._hidden(inputs, cache, path)
        scores = score_positions(lambda start, stop: self._logits(h[:, start:stop], path.head, path.draft, exact),
                                 targets)
        return self._logits(h[:, -1:], path.head, path.draft, exact), scores

    def _layer(self, index: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor, cache: KVCache, draft: bool = False, exact: bool = False) -> torch.Tensor:
        rows, new, _ = h.shape
        dims = self.dims
        few = rows * new <= cpu_kernels.MAX_ROWS  # decode steps, draft verification, short prefills
        fused = self._fused_layers[index] if self._fused_layers is not None and few else None
        ops = dims.ops
        if fused is not None and draft and self._dense_layers is not None:
            ops, draft_layers = self._int8_drafts()
            fused = draft_layers[index]
        if fused is not None and ops is not None:
            slots = cache.reserve(new)  # first: reserving may grow the pool
            k_pool, v_pool = cache.buffers(index, dims.num_kv_heads, dims.head_dim, self.dtype)
            return ops.decode_layer(h, *fused, k_pool, v_pool, slots, cos, sin, mask, dims.num_heads,
                                    dims.num_kv_heads, dims.eps, self.spec.attention_scale)
        q, k, v = self._pre(h, cos, sin, *layer.pre, dims, exact)  # [rows, new, heads, head_dim]
        if dims.ops is not None and new <= cpu_kernels.MAX_ROWS:  # every verification: exact whatever the batch
            k_pool, v_pool, slots = cache.write(index, k.transpose(1, 2), v.transpose(1, 2))
            attn = dims.ops.decode_attention(q, k_pool, v_pool, mask, self.spec.attention_scale, slots)
        else:
            keys, values = cache.append(index, k.transpose(1, 2), v.transpose(1, 2))  # [rows, kv, total, dim]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                                  scale=self.spec.attention_scale, enable_gqa=True)
            attn = attn.transpose(1, 2).reshape(rows, new, -1)  # [rows, new, heads * head_dim]
        return self._post(h, attn, *layer.post, dims, exact)

    def _int8_drafts(self) -> tuple[CpuOps, list[FusedLayer]]:
        """The draft layers: each projection of the dense layers as LLM.int8() codes (per-row absmax
        scales, DRAFT_INT8_THRESHOLD outliers), on the kernels' int8 variant; made once."""
        if self._draft_layers is None:
            assert self._dense_layers is not None
            start = time.perf_counter()
            ops = cpu_kernels.load(self.config.kernel_switch, "int8")
            assert ops is not None, "the int8 kernels load wherever the dense ones did"
            layers = [FusedLayer(_dense(lw.pre[0]), int8_projection(ops, lw.pre[1], lw.pre[2]),
                                 int8_projection(ops, lw.post[0], lw.post[1]), _dense(lw.post[3]),
                                 int8_projection(ops, lw.post[4], lw.post[5]),
                                 int8_projection(ops, lw.post[6], lw.post[7])) for lw in self._dense_layers]
            self._draft_layers = (ops, layers)
            logger.info(f"{self.name}: verified-mode drafts read an int8 copy of the decoder layers "
                        f"({sum(_int8_bytes(f) for f in layers) / 2**20:.0f} MiB, {ops.variant} kernels, made in "
                        f"{time.perf_counter() - start:.1f} s; TGI_DRAFT_WEIGHTS=model drafts on the model's weights)")
        return self._draft_layers

    def _int8_head(self, head: torch.Tensor) -> KernelProjection:
        """A draft head (the lm_head or a reduced head's rows) as weight-only int8 in blocks
        (int8_head), made at its first draft and kept with the tensor it was made from (so its
        address is not reused). Not LLM.int8(): the final norm's output has many columns over
        DRAFT_INT8_THRESHOLD, and each outlier column is read across every vocabulary row, which
        makes such a head slower than the dense one."""
        key = (head.data_ptr(), int(head.shape[0]))
        made = self._draft_heads.get(key)
        if made is None:
            ops, _ = self._int8_drafts()
            made = self._draft_heads[key] = (head, int8_head(ops, head)[:])
            logger.info(f"{self.name}: a draft head of {key[1]} rows is read as weight-only int8 "
                        f"({key[1] * head.shape[1] / 2**20:.0f} MiB)")
        return made[1]

    def _logits(self, h: torch.Tensor, head: torch.Tensor | None = None, draft: bool = False,
                exact: bool = False) -> torch.Tensor:
        h = rms_norm(h.contiguous(), self.final_norm, self.dims)
        # A verified-mode draft may pass a reduced head (rows of lm_head, see speculative/draft_head.py).
        full = self.head_projection if self.head_projection is not None else self.lm_head
        assert full is not None
        weights: Any = head if head is not None else full
        # A draft reads a dense head as int8; an lm_head the runner already reads as int8 is reused.
        if (draft and self._dense_layers is not None and h.shape[0] * h.shape[1] <= cpu_kernels.MAX_ROWS
                and isinstance(weights, torch.Tensor)):
            weights = self._int8_head(weights)
        logits = linear(h, weights, None, self.dims, exact)  # [rows, positions, vocab]
        if self.spec.final_logit_softcap is not None:
            cap = self.spec.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def warm_up(self, max_rows: int = 1) -> float:
        """Run one prefill and one decode step per row count (compiles them); returns seconds."""
        start = time.perf_counter()
        for rows in sorted({1, max_rows}):
            cache = self.new_cache(rows)
            ids = torch.zeros((rows, 4), dtype=torch.long)
            self.forward(ForwardInputs.contiguous(ids), cache)
            self.forward(ForwardInputs.contiguous(ids[:, :1], 4), cache)
        seconds = time.perf_counter() - start
        logger.info(f"{self.name} warm-up (compile={self.config.compile}) took {seconds:.1f} s")
        return seconds


INT8_HEAD_BLOCK = 64


@dataclass(frozen=True)
class Int8Head:
    """An lm_head (or some of its rows) as weight-only int8: per block of INT8_HEAD_BLOCK weights
    of a row, codes round(w * 127 / absmax) and scale absmax / 127. `head[:n]` is the kernels'
    product of its first n rows (views, no copy)."""

    ops: CpuOps
    codes: torch.Tensor  # [rows, hidden] int8
    scales: torch.Tensor  # [rows, hidden // INT8_HEAD_BLOCK] float32
    int8_x: bool = False  # x quantized to int8 per 32 values (TGI_QUANTIZED_ACTIVATIONS=int8)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def take(self, ids: torch.Tensor) -> Int8Head:
        """Rows `ids`, in that order (a reduced draft head: the served head's own numbers)."""
        return Int8Head(self.ops, self.codes.index_select(0, ids), self.scales.index_select(0, ids), self.int8_x)

    def __getitem__(self, rows: slice) -> KernelProjection:
        return self.ops.Projection.int8_weights(self.codes[rows], self.scales[rows].reshape(-1), INT8_HEAD_BLOCK, None,
                                                int8_x=self.int8_x)


def int8_head(ops: CpuOps, weight: torch.Tensor | CheckpointTensor, int8_x: bool = False) -> Int8Head:
    """`weight` `[vocab, hidden]` (loaded, or read from the checkpoint) as an Int8Head, quantized a
    few MiB of rows at a time (no float32 copy of the whole head); int8_x: its products quantize x."""
    vocab, hidden = weight.shape
    codes = torch.empty((vocab, hidden), dtype=torch.int8)
    scales = torch.empty((vocab, hidden // INT8_HEAD_BLOCK), dtype=torch.float32)
    step = max(1, (4 << 20) // (hidden * 4))
    for start in range(0, vocab, step):
        blocks = weight[start:start + step].float().view(-1, hidden // INT8_HEAD_BLOCK, INT8_HEAD_BLOCK)
        scale = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)  # [rows, blocks, 1]
        codes[start:start + step] = torch.round(blocks / scale).to(torch.int8).view(-1, hidden)
        scales[start:start + step] = scale.squeeze(-1)
    return Int8Head(ops, codes, scales, int8_x)


DRAFT_INT8_THRESHOLD = 6.0  # bitsandbytes' default llm_int8_threshold


def int8_projection(ops: CpuOps, weight: Any, bias: Any) -> KernelProjection:
    """A dense `[n, k]` weight as LLM.int8() codes: per row, round(w * 127 / absmax) and absmax
    (what bitsandbytes' Linear8bitLt stores as CB and SCB)."""
    assert isinstance(weight, torch.Tensor), f"int8 drafts quantize dense weights, got {type(weight).__name__}"
    w = weight.float()
    absmax = w.abs().amax(dim=1).clamp(min=1e-30)
    codes = torch.round(w * (127.0 / absmax[:, None])).to(torch.int8)
    return ops.Projection.int8(codes, absmax.contiguous(), bias, DRAFT_INT8_THRESHOLD)


def _int8_bytes(layer: FusedLayer) -> int:
    return sum(p.n * p.k for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))


def _model_dtype(model: Any) -> torch.dtype:
    dtype = model.model.embed_tokens.weight.dtype
    assert isinstance(dtype, torch.dtype)
    return dtype


def read_final_norm(model: Any, spec: ArchSpec, dtype: torch.dtype) -> torch.Tensor:
    return norm_weight(model.model.norm, spec.family, dtype)
