"""The compiled CPU kernels (runner/cpu_kernels.cpp, kernels/) against float64 references and torch.

Every kernel test runs once per ISA variant the CPU can run (the `ops` fixture): an AVX-512 CI
machine checks its own variants and the AVX2 one; a variant the CPU lacks is skipped, saying so.

Tolerances: fp32 outputs within 1e-5 relative to the output scale (fp32 accumulation of at
most 1536 products); bf16 outputs within 2**-7 relative, one bf16 rounding of the output
(inputs are bf16 already, the products are exact in fp32, the accumulation is fp32).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from text_generation_server.env import process_env
from text_generation_server.models.runner import cpu_kernels

REASON = cpu_kernels.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernel unavailable here: {REASON}")
SHAPES = [(1, 1), (3, 33), (4, 32), (5, 575), (577, 576), (64, 1536)]  # (n, k): tails of rows and of k


@pytest.fixture(scope="module", params=[variant.name for variant in cpu_kernels.VARIANTS])
def ops(request: pytest.FixtureRequest) -> cpu_kernels.CpuOps:
    variant = cpu_kernels.BY_NAME[request.param]
    if REASON is not None:
        pytest.skip(f"kernels unavailable here: {REASON}")
    if variant not in cpu_kernels.runnable_variants():
        missing = sorted(set(variant.cpu_flags) - cpu_kernels.cpu_flags())
        pytest.skip(f"the {variant.name} variant needs {', '.join(missing)}, which this CPU lacks")
    loaded = cpu_kernels.load_variant(variant.name)
    assert loaded.variant == variant.name
    return loaded


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_float64_products(ops: cpu_kernels.CpuOps, dtype: torch.dtype, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    for rows in range(1, cpu_kernels.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=generator).to(dtype)
        for b in (None, bias):
            out = ops.small_m_linear(x, weight, b)
            assert out.dtype == dtype and out.shape == (rows, n)
            expected = _reference(x, weight, b)
            scale = expected.abs().max().item() + 1.0
            relative = 1e-5 if dtype == torch.float32 else 2**-7
            error = (out.double() - expected).abs().max().item()
            assert error <= relative * scale, f"{rows} rows x [{n}, {k}] {dtype} bias={b is not None}: error {error}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_does_not_depend_on_the_other_rows(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    """Every x row's output is bit for bit its product alone, at 1-16 rows: the tile shapes that
    m picks (4 x 4 tiles, pairs of weight rows, AVX2's tall tiles) sum each output in one order.
    Verified mode relies on it: a (k+1)-token verification computes what k + 1 steps would."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(37, 600, generator=generator).to(dtype)  # 9 blocks of 4 rows and a single row
    bias = torch.randn(37, generator=generator).to(dtype)
    x = torch.randn(cpu_kernels.MAX_ROWS, 600, generator=generator).to(dtype)
    alone = torch.cat([ops.small_m_linear(x[j : j + 1], weight, bias) for j in range(len(x))])
    for rows in range(2, cpu_kernels.MAX_ROWS + 1):
        out = ops.small_m_linear(x[:rows], weight, bias)
        assert torch.equal(out, alone[:rows]), f"{ops.variant} {dtype}: {rows} rows differ from one at a time"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_projection_beyond_16_rows(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    """Prefill-sized x: fp32 up to 64 rows and bf16 up to 32 in chunks of at most 16 on the
    kernels (each chunk equal to the product of those rows alone), more rows on torch's GEMM."""
    generator = torch.Generator().manual_seed(17)
    weight = torch.randn(67, 96, generator=generator).to(dtype)
    bias = torch.randn(67, generator=generator).to(dtype)
    projection = ops.Projection.dense(weight, bias)
    for rows in (17, 33, 64, 65, 100):
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        out = projection(x)
        expected = _reference(x, weight, bias)
        relative = 1e-5 if dtype == torch.float32 else 2**-7
        assert (out.double() - expected).abs().max().item() <= relative * (expected.abs().max().item() + 1.0)
        if rows <= (64 if dtype == torch.float32 else 32):
            size = -(-rows // -(-rows // cpu_kernels.MAX_ROWS))  # even chunks
            assert torch.equal(out[:size], ops.small_m_linear(x[:size].contiguous(), weight, bias)), rows


@needs_kernel
def test_refuses_bad_input_by_name(ops: cpu_kernels.CpuOps) -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="17 rows; at most 16"):
        ops.small_m_linear(torch.randn(17, 16), weight, None)
    with pytest.raises(RuntimeError, match="x is BFloat16 but weight is Float"):
        ops.small_m_linear(torch.randn(1, 16).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="x has 15 features, weight 16"):
        ops.small_m_linear(torch.randn(1, 15), weight, None)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.small_m_linear(torch.randn(16, 2).T, weight, None)
    with pytest.raises(RuntimeError, match="bias has 7 values, weight 8 rows"):
        ops.small_m_linear(torch.randn(1, 16), weight, torch.randn(7))
    with pytest.raises(RuntimeError, match="dtype Half is not supported"):
        ops.small_m_linear(torch.randn(1, 16).half(), weight.half(), None)


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected.double()).abs().max() / (expected.double().abs().max() + 1e-30))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_formula(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    for shape in [(1, 1, 576), (3, 5, 64), (2, 7)]:
        x = (torch.randn(shape, generator=generator) * 3).to(dtype)
        weight = torch.randn(shape[-1], generator=generator).to(dtype)
        variance = x.double().pow(2).mean(-1, keepdim=True)
        expected = x.double() * torch.rsqrt(variance + 1e-5) * weight.double()
        error = _relative_error(ops.rms_norm(x, weight, 1e-5), expected)
        assert error <= (1e-6 if dtype == torch.float32 else 2**-7), f"{shape} {dtype}: relative error {error}"
    with pytest.raises(RuntimeError, match="x has 8 features, weight 4"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5)


def _assert_attention_matches_sdpa(ops: cpu_kernels.CpuOps, q: torch.Tensor, keys: torch.Tensor,
                                   values: torch.Tensor, mask: torch.Tensor) -> None:
    """decode_attention against float64 SDPA (grouped heads): 1e-6 relative in fp32, 2**-7 in bf16."""
    rows, new, heads, dim = q.shape
    out = ops.decode_attention(q, keys, values, mask, dim**-0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), keys.double(), values.double(), attn_mask=mask.double(), scale=dim**-0.5,
        enable_gqa=True).transpose(1, 2).reshape(rows, new, heads * dim)
    error = _relative_error(out, expected)
    assert error <= (1e-6 if q.dtype == torch.float32 else 2**-7), f"{q.dtype}: relative error {error}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_equals_the_contiguous_cache(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    """A paged cache (each row's columns in scattered slots, padding on the zero slot) gives the
    bits the same columns give in a contiguous cache; a slot past the pool is refused."""
    generator = torch.Generator().manual_seed(5)
    rows, heads, kv_heads, dim, total, blocks, size = 3, 8, 2, 64, 45, 50, 4
    capacity = blocks * size
    pool_k = torch.randn(blocks, kv_heads, size, dim, generator=generator).to(dtype)
    pool_v = torch.randn(blocks, kv_heads, size, dim, generator=generator).to(dtype)
    pool_k[0], pool_v[0] = 0, 0
    slots = torch.randperm(capacity - size, generator=generator)[: rows * total].view(rows, total) + size
    slots[2, :7] = 0  # row 2 is left-padded
    q = torch.randn(rows, 3, heads, dim, generator=generator).to(dtype)
    allowed = torch.ones(rows, 3, total, dtype=torch.bool).tril(total - 3)
    allowed[2, :, :7] = False
    mask = torch.zeros(rows, 1, 3, total, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    keys = pool_k.transpose(1, 2)[slots // size, slots % size].transpose(1, 2)  # [rows, kv, total, dim]
    values = pool_v.transpose(1, 2)[slots // size, slots % size].transpose(1, 2)
    paged = ops.decode_attention(q, pool_k, pool_v, mask, dim**-0.5, slots)
    assert torch.equal(paged, ops.decode_attention(q, keys, values, mask, dim**-0.5))
    slots[1, 4] = capacity
    with pytest.raises(RuntimeError, match=f"slot id {capacity} outside the pool's {capacity} slots"):
        ops.decode_attention(q, pool_k, pool_v, mask, dim**-0.5, slots)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa_on_cache_views(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    """Grouped heads, left padding in the mask, keys/values as views of a larger cache buffer."""
    generator = torch.Generator().manual_seed(2)
    rows, heads, kv_heads, dim, total, capacity = 3, 9, 3, 64, 37, 64
    keys = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)[:, :, :total]
    values = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)[:, :, :total]
    qkv = torch.randn(rows, 1, heads + kv_heads, dim, generator=generator).to(dtype)
    q = qkv[:, :, :heads]  # a view, as the runner passes it
    allowed = torch.ones(rows, total, dtype=torch.bool)
    allowed[1, :10] = False  # row 1 is left-padded
    mask = torch.zeros(rows, 1, 1, total, dtype=dtype).masked_fill_(~allowed[:, None, None], torch.finfo(dtype).min)
    _assert_attention_matches_sdpa(ops, q, keys, values, mask)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.decode_attention(qkv.transpose(1, 2), keys, values, mask, 1.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_rope_match_torch(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    """silu's exp is vectorized (within 2 ulp of expf); gates out to +-120 cover its clamping."""
    generator = torch.Generator().manual_seed(4)
    for inner in (1, 37, 1536):
        gate_up = (torch.randn(3, 2 * inner, generator=generator) * 6).to(dtype)
        gate_up[0, :inner:3] *= 20
        gate, up = gate_up.double().chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        error = _relative_error(ops.silu_mul(gate_up), expected)
        assert error <= (1e-6 if dtype == torch.float32 else 2**-7), f"silu_mul {inner} {dtype}: error {error}"
        gate_up[1, 0] = float("nan")  # in a whole vector (rounded to bf16 by simd::store_bf16) or the tail
        assert ops.silu_mul(gate_up)[1, 0].isnan(), f"silu_mul {inner} {dtype}: a NaN gate gave a number"
    x = torch.randn(2, 3, 5, 64, generator=generator).to(dtype)  # [rows, new, heads, dim]
    cos, sin = torch.randn(2, 3, 1, 64, generator=generator).to(dtype), torch.randn(2, 3, 1, 64).to(dtype)
    expected = x.double() * cos.double() + x.double().roll(32, dims=-1) * sin.double()
    error = _relative_error(ops.rope(x, cos, sin), expected)
    assert error <= (1e-6 if dtype == torch.float32 else 2**-7), f"rope {dtype}: error {error}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_several_new_tokens_is_causal_over_cache_and_new(ops: cpu_kernels.CpuOps,
                                                                     dtype: torch.dtype) -> None:
    """Draft verification: 5 new tokens per row after 30 cached columns, a causal mask among them."""
    generator = torch.Generator().manual_seed(3)
    rows, new, heads, kv_heads, dim, cached, capacity = 2, 5, 6, 2, 64, 30, 64
    total = cached + new
    keys = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)[:, :, :total]
    values = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)[:, :, :total]
    qkv = torch.randn(rows, new, heads + 2 * kv_heads, dim, generator=generator).to(dtype)
    q = qkv[:, :, :heads]
    allowed = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]  # [new, total]
    allowed = allowed[None].repeat(rows, 1, 1)
    allowed[1, :, :7] = False  # row 1 is left-padded
    mask = torch.zeros(rows, 1, new, total, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    _assert_attention_matches_sdpa(ops, q, keys, values, mask)
    with pytest.raises(RuntimeError, match="mask must be a contiguous"):
        ops.decode_attention(q, keys, values, mask[:, :, :1], dim**-0.5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_blocks_and_tails(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    """Odd shapes for the blocked kernel: dim 72 (a tail after the whole vectors), 21 columns (a
    short last group of four keys), 7 heads per kv head x 3 new tokens (blocks of an odd size)."""
    generator = torch.Generator().manual_seed(5)
    rows, new, heads, kv_heads, dim, total = 2, 3, 14, 2, 72, 21
    keys = torch.randn(rows, kv_heads, total, dim, generator=generator).to(dtype)
    values = torch.randn(rows, kv_heads, total, dim, generator=generator).to(dtype)
    q = torch.randn(rows, new, heads, dim, generator=generator).to(dtype)
    allowed = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
    mask = torch.zeros(rows, 1, new, total, dtype=dtype).masked_fill_(~allowed[None, None], torch.finfo(dtype).min)
    _assert_attention_matches_sdpa(ops, q, keys, values, mask)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_attention_does_not_depend_on_masked_columns(ops: cpu_kernels.CpuOps, dtype: torch.dtype) -> None:
    """A query's real columns may lie among masked ones: left padding, the columns of a row's
    rejected drafts (masked in place), the later queries of a verification forward. Its output is
    bit for bit that of its real columns alone, for counts around the vector widths (8 and 16
    lanes): verified mode's greedy identity, and a request's independence of its batch, rest on it."""
    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, most = 14, 2, 64, 40
    keys = torch.randn(1, kv_heads, most, dim, generator=generator).to(dtype)
    values = torch.randn(1, kv_heads, most, dim, generator=generator).to(dtype)
    q = torch.randn(1, 1, heads, dim, generator=generator).to(dtype)
    for seen in range(1, most + 1):
        alone = ops.decode_attention(q, keys[:, :, :seen], values[:, :, :seen],
                                     torch.zeros(1, 1, 1, seen, dtype=dtype), dim**-0.5)
        for before, between, after in ((0, 0, 1), (0, 0, 16), (3, 0, 0), (5, 2, 7), (16, 1, 0), (1, 9, 13)):
            middle = seen // 2  # `between` masked columns after the first `middle` real ones
            real = torch.tensor([before + j + (between if j >= middle else 0) for j in range(seen)])
            width = before + seen + between + after
            wide_keys = torch.randn(1, kv_heads, width, dim, generator=generator).to(dtype)
            wide_values = torch.randn(1, kv_heads, width, dim, generator=generator).to(dtype)
            wide_keys[:, :, real], wide_values[:, :, real] = keys[:, :, :seen], values[:, :, :seen]
            mask = torch.full((1, 1, 1, width), torch.finfo(dtype).min, dtype=dtype)
            mask[..., real] = 0
            out = ops.decode_attention(q, wide_keys, wide_values, mask, dim**-0.5)
            assert torch.equal(out, alone), f"{ops.variant} {dtype}: {seen} real columns, {before} / {between} / " \
                                            f"{after} masked before / between / after"


@needs_kernel
def test_runs_on_torchs_openmp_runtime(ops: cpu_kernels.CpuOps) -> None:
    """A second libgomp would bring a second thread team spinning on the same cores."""
    ops.small_m_linear(torch.randn(1, 64), torch.randn(256, 64), None)
    torch.randn(64, 64) @ torch.randn(64, 64)
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, f"more than one OpenMP runtime loaded: {sorted(runtimes)}"


def test_linear_usable_only_for_few_rows_of_a_supported_dtype() -> None:
    weight = torch.randn(8, 16)
    assert cpu_kernels.linear_usable(torch.randn(2, 8, 16), weight)  # 16 rows
    assert not cpu_kernels.linear_usable(torch.randn(17, 16), weight)
    assert not cpu_kernels.linear_usable(torch.randn(1, 16).half(), weight.half())
    assert not cpu_kernels.linear_usable(torch.randn(1, 16).bfloat16(), weight)
    assert not cpu_kernels.linear_usable(torch.randn(1, 16), torch.randn(16, 8).T)


def test_switch_off_and_bad_switch() -> None:
    assert cpu_kernels.unavailable_reason("off") == "TGI_CPU_KERNELS=off"
    with pytest.raises(ValueError, match="TGI_CPU_KERNELS='fast' is not one of auto, off"):
        cpu_kernels.unavailable_reason("fast")
    assert cpu_kernels.load("OFF") is None


def test_build_folder_changes_with_the_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = cpu_kernels.build_dir()
    assert folder.parent == process_env().kernels.folder and folder.name.startswith(cpu_kernels.NAME)
    changed = tmp_path / "changed.cpp"
    changed.write_text(cpu_kernels.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", changed)
    assert cpu_kernels.build_dir() != folder


def _load_in_subprocess(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """cpu_kernels.load() in a fresh process (load() is cached per process, the env read once)."""
    code = ("from text_generation_server.models.runner import cpu_kernels as c\n"
            "print('LOADED' if c.load() is not None else 'FALLBACK')")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)


@needs_kernel
def test_without_a_compiler_the_runner_falls_back_loudly(tmp_path: Path) -> None:
    result = _load_in_subprocess({"TGI_KERNEL_DIR": str(tmp_path / "empty"), "CXX": str(tmp_path / "no-c++")})
    assert result.stdout.strip().endswith("FALLBACK"), result.stdout + result.stderr
    assert "CPU kernels unavailable (building cpu_kernels.cpp failed" in result.stderr


@needs_kernel
def test_a_prebuilt_folder_loads_without_a_compiler(tmp_path: Path) -> None:
    """The image's case: kernels compiled at build time into TGI_KERNEL_DIR, no g++ at run time."""
    assert cpu_kernels.load() is not None
    built = cpu_kernels.build_dir()
    shutil.copytree(built, tmp_path / built.name)
    result = _load_in_subprocess({"TGI_KERNEL_DIR": str(tmp_path), "CXX": str(tmp_path / "no-c++")})
    assert result.stdout.strip().endswith("LOADED"), result.stdout + result.stderr
