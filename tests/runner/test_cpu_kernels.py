"""The AVX-512 small-matrix kernel (runner/small_m_linear.cpp) against float64 products.

Tolerances: fp32 outputs within 1e-5 relative to the output scale (fp32 accumulation of at
most 1536 products); bf16 outputs within 2**-7 relative, one bf16 rounding of the output
(inputs are bf16 already, the products are exact in fp32, the accumulation is fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from text_generation_server.models.runner import cpu_kernels

REASON = cpu_kernels.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernel unavailable here: {REASON}")
SHAPES = [(1, 1), (3, 33), (4, 32), (5, 575), (577, 576), (64, 1536)]  # (n, k): tails of rows and of k


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.SmallMLinear:
    function = cpu_kernels.small_m_linear()
    assert function is not None, "the kernel did not build: see the warning in the log"
    return function


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_float64_products(kernel: cpu_kernels.SmallMLinear, dtype: torch.dtype, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    for rows in range(1, cpu_kernels.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=generator).to(dtype)
        for b in (None, bias):
            out = kernel(x, weight, b)
            assert out.dtype == dtype and out.shape == (rows, n)
            expected = _reference(x, weight, b)
            scale = expected.abs().max().item() + 1.0
            relative = 1e-5 if dtype == torch.float32 else 2**-7
            error = (out.double() - expected).abs().max().item()
            assert error <= relative * scale, f"{rows} rows x [{n}, {k}] {dtype} bias={b is not None}: error {error}"


@needs_kernel
def test_refuses_bad_input_by_name(kernel: cpu_kernels.SmallMLinear) -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="17 rows; at most 16"):
        kernel(torch.randn(17, 16), weight, None)
    with pytest.raises(RuntimeError, match="x is BFloat16 but weight is Float"):
        kernel(torch.randn(1, 16).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="x has 15 features, weight 16"):
        kernel(torch.randn(1, 15), weight, None)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        kernel(torch.randn(16, 2).T, weight, None)
    with pytest.raises(RuntimeError, match="bias has 7 values, weight 8 rows"):
        kernel(torch.randn(1, 16), weight, torch.randn(7))
    with pytest.raises(RuntimeError, match="dtype Half is not supported"):
        kernel(torch.randn(1, 16).half(), weight.half(), None)


@needs_kernel
def test_runs_on_torchs_openmp_runtime(kernel: cpu_kernels.SmallMLinear) -> None:
    """A second libgomp would bring a second thread team spinning on the same cores."""
    kernel(torch.randn(1, 64), torch.randn(256, 64), None)
    torch.randn(64, 64) @ torch.randn(64, 64)
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, f"more than one OpenMP runtime loaded: {sorted(runtimes)}"


def test_usable_only_for_few_rows_of_a_supported_dtype() -> None:
    weight = torch.randn(8, 16)
    assert cpu_kernels.usable(torch.randn(2, 8, 16), weight)  # 16 rows
    assert not cpu_kernels.usable(torch.randn(17, 16), weight)
    assert not cpu_kernels.usable(torch.randn(1, 16).half(), weight.half())
    assert not cpu_kernels.usable(torch.randn(1, 16).bfloat16(), weight)
    assert not cpu_kernels.usable(torch.randn(1, 16), torch.randn(16, 8).T)


def test_switch_off_and_bad_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "off")
    assert cpu_kernels.unavailable_reason() == "TGI_CPU_KERNELS=off"
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "fast")
    with pytest.raises(ValueError, match="TGI_CPU_KERNELS='fast' is not one of auto, off"):
        cpu_kernels.unavailable_reason()


def test_build_folder_changes_with_the_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path))
    folder = cpu_kernels.build_dir()
    assert folder.parent == tmp_path and folder.name.startswith(cpu_kernels.NAME)
    changed = tmp_path / "changed.cpp"
    changed.write_text(cpu_kernels.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", changed)
    assert cpu_kernels.build_dir() != folder
