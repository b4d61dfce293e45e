"""The kernels' bitsandbytes products against bitsandbytes itself and float64 references.

Once per ISA variant the CPU can run (test_cpu_kernels' `ops` fixture). Tolerances:
- 4-bit with int8 activations (TGI_QUANTIZED_ACTIVATIONS=int8): against its own definition in float64
  (x rounded to int8 per 32 values, the table to int8, the integer sums exact): within 1e-6
  relative (measured 6e-8..1.2e-7: fp32 scaling of exact chunk sums).
- 4-bit (nf4, fp4), fp32 activations: bitsandbytes' own path is dequantize (fp32, exact values)
  then F.linear; the kernel decodes the same values, so only the order of fp32 sums differs:
  within 1e-5 relative to the output scale of x @ dequantize_4bit(W).T in float64 (measured
  5e-7..1.5e-6 on this machine). bf16 activations: bitsandbytes rounds the dequantized weights
  to bf16 and calls F.linear in bf16; within 2**-7 relative (one bf16 rounding of the output).
- int8 (LLM.int8(), threshold 6 with outlier columns, and threshold 0): the int part is exact
  in both, the dequantization runs the same fp32 operations in the same order; only the order
  of the outlier columns' sum differs: within 1e-6 relative of bnb.matmul (measured 1.2e-7;
  exactly 0 without outliers). The kernels take a row's outlier columns from that row alone
  (bitsandbytes from every row of the batch), so each row is compared with bnb.matmul of that
  row alone.
Every row of a product of 1-16 rows is bit for bit that row's product alone, in every format:
verified mode's exactness over bitsandbytes models rests on it.
"""

from __future__ import annotations

import pytest
import torch

from text_generation_server.models.runner import cpu_kernels

from .test_cpu_kernels import ops  # noqa: F401 - the per-variant fixture

bnb = pytest.importorskip("bitsandbytes")
functional = pytest.importorskip("bitsandbytes.functional")

ROWS = [*range(1, 17), 20, 37]  # 20, 37: beyond the kernels' 16 rows (run in chunks of at most 16)


def _relative(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected.double()).abs().max() / (expected.double().abs().max() + 1.0))


def _nibbles(codes: torch.Tensor, count: int) -> torch.Tensor:
    """Element e's code: the high nibble of codes[e // 2] for even e, the low one for odd e."""
    e = torch.arange(count)
    return torch.where(e % 2 == 0, codes[e // 2] >> 4, codes[e // 2] & 15).long()


def _four_bit(ops, weight: torch.Tensor, quant_type: str, blocksize: int, bias: torch.Tensor | None,  # noqa: F811
              int8_x: bool = False):
    """The kernels' projection and the weights by bitsandbytes' definition of its format: element e
    of the flattened weight is table[nibble e] * absmax[e // blocksize], the high nibble first;
    with int8_x (int8 activations) the table is rounded to int8 steps of max|t| / 127.

    bitsandbytes' own `dequantize_4bit` computes that, but its CPU kernel for AVX-512 BF16 (0.50.2)
    misreads absmax blocks that span two weight rows (measured: errors of 2.0 on [7, 96] with
    blocksize 64); where blocks stay within rows it is checked to agree exactly."""
    packed, state = functional.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type)
    table = functional.get_4bit_type(quant_type, device="cpu").float()
    n, k = weight.shape
    codes = packed.view(torch.uint8).reshape(-1)
    projection = ops.Projection.four_bit(codes, state.absmax.float(), table, blocksize, n, k, bias, int8_x=int8_x)
    absmax = state.absmax.float()[torch.arange(n * k) // blocksize]
    if int8_x:
        top = table.abs().max()
        steps = torch.round(table * (127.0 / top)).double() * float(top / 127.0)
        return projection, (steps[_nibbles(codes, n * k)] * absmax.double()).view(n, k)
    dense = (table[_nibbles(codes, n * k)] * absmax).view(n, k)
    if k % blocksize == 0:
        assert torch.equal(functional.dequantize_4bit(packed, state), dense)
    return projection, dense


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(("n", "k", "blocksize"), [(1, 32, 32), (5, 64, 64), (37, 96, 32), (7, 96, 64),
                                                   (2, 64, 128), (129, 576, 64)])
def test_four_bit_equals_dequantize_then_matmul(ops, quant_type: str, n: int, k: int,  # noqa: F811
                                                blocksize: int) -> None:
    """(7, 96, 64) and (2, 64, 128): absmax blocks that span two weight rows."""
    generator = torch.Generator().manual_seed(n * 100 + k)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    bias = torch.randn(n, generator=generator)
    for with_bias in (None, bias):
        projection, dense = _four_bit(ops, weight, quant_type, blocksize, with_bias)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator)
            expected = x.double() @ dense.double().T + (with_bias.double() if with_bias is not None else 0.0)
            error = _relative(projection(x), expected)
            assert error <= 1e-5, f"{quant_type} [{n}, {k}] blocksize {blocksize}, {rows} rows: error {error}"


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(("n", "k", "blocksize"), [(1, 32, 32), (5, 64, 64), (37, 96, 32), (7, 96, 64),
                                                   (2, 64, 128), (129, 576, 64)])
def test_four_bit_with_int8_activations_follows_its_definition(ops, quant_type: str, n: int, k: int,  # noqa: F811
                                                               blocksize: int) -> None:
    """Each 32 values of an x row as round(x * 127 / max|x|) times max|x| / 127; the table as
    round(t * 127 / max|t|) times max|t| / 127; the weights' absmax as they are."""
    generator = torch.Generator().manual_seed(n * 100 + k)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    bias = torch.randn(n, generator=generator)
    projection, weights = _four_bit(ops, weight, quant_type, blocksize, bias, int8_x=True)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=generator) * 3
        x[0, :32] = 0.0  # a chunk of zeros: scale 0
        error = _relative(projection(x), _int8_rows(x) @ weights.T + bias.double())
        assert error <= 1e-6, f"{quant_type} [{n}, {k}] blocksize {blocksize}, {rows} rows: error {error}"


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8-activation products read it, in float64: each 32 values as
    round(x * 127 / max|x|) * max|x| / 127 (0 where the 32 are all 0)."""
    chunks = x.view(x.shape[0], -1, 32)
    most = chunks.abs().amax(-1, keepdim=True)
    factor = torch.full_like(most, 127.0) / most  # one fp32 division (`127.0 / most` is 127 * (1 / most))
    values = torch.round(chunks * torch.where(most > 0, factor, torch.zeros_like(most)))
    return (values.double() * (most / 127.0).double()).view(x.shape)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_four_bit_bf16_rounds_weights_as_bitsandbytes(ops, quant_type: str) -> None:  # noqa: F811
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(67, 128, generator=generator) / 8
    bias = torch.randn(67, generator=generator)
    projection, dense = _four_bit(ops, weight, quant_type, 64, bias.bfloat16())
    for rows in (1, 2, 5, 8, 16, 20, 37):  # 2-16: the avx512_bf16 variant's bf16 products; more: chunks
        x = torch.randn(rows, 128, generator=generator).bfloat16()
        expected = torch.nn.functional.linear(x, dense.bfloat16(), bias.bfloat16())  # bitsandbytes' bf16 path
        out = projection(x)
        assert out.dtype == torch.bfloat16
        error = _relative(out, expected)
        assert error <= 2**-7, f"{quant_type} bf16, {rows} rows: error {error}"


def _row_by_row(product, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([product(x[j : j + 1]) for j in range(len(x))])


def _bnb_int8(weight: torch.Tensor, threshold: float):
    codes, scales, _ = functional.int8_vectorwise_quant(weight.half())
    state = bnb.MatmulLtState()
    state.CB, state.SCB, state.threshold = codes, scales, threshold
    state.has_fp16_weights = state.is_training = False
    return codes, scales, state


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("threshold", [6.0, 0.0])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 33), (37, 96), (129, 576)])
def test_int8_equals_bitsandbytes_matmul(ops, threshold: float, n: int, k: int) -> None:  # noqa: F811
    """Outlier columns (|x| >= 6 in some rows) in half of the batches; k tails of 1 and 33."""
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    bias = torch.randn(n, generator=generator)
    codes, scales, state = _bnb_int8(weight, threshold)
    for with_bias in (None, bias):
        projection = ops.Projection.int8(codes, scales, with_bias, threshold)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator) * 2
            if rows % 2:
                x[rows // 2, k // 2] = 9.0  # an outlier column
                x[0, 0] = -7.5
            expected = _row_by_row(lambda row, b=with_bias: bnb.matmul(row, codes, state=state, bias=b), x)
            error = _relative(projection(x), expected)
            assert error <= 1e-6, f"int8 [{n}, {k}] threshold {threshold}, {rows} rows: error {error}"


def test_int8_is_the_same_on_every_variant() -> None:
    """LLM.int8()'s int part is exact in int32 on every variant (maddubs, VNNI, AMX tiles) and the
    steps after it are the same fp32 operations in one order: the outputs are equal bit for bit."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 4864 + 33, generator=generator) / 70  # row tails, a 9-row last tile of 16
    codes, scales, _ = _bnb_int8(weight, 6.0)
    bias = torch.randn(300, generator=generator)
    x = torch.randn(16, weight.shape[1], generator=generator) * 2
    x[3, 100] = x[9, 2000] = 8.0  # outlier columns
    outputs = {}
    for variant in cpu_kernels.runnable_variants():
        projection = cpu_kernels.load_variant(variant.name).Projection.int8(codes, scales, bias, 6.0)
        outputs[variant.name] = [projection(x[:rows]) for rows in (1, 2, 5, 7, 16)]
    first, *others = outputs
    for name in others:
        for a, b in zip(outputs[first], outputs[name], strict=True):
            assert torch.equal(a, b), f"{first} and {name} differ"


@pytest.mark.parametrize("weights", ["nf4", "int8 blocks"])
def test_int8_activations_are_the_same_on_every_variant(weights: str) -> None:
    """With int8 activations every chunk's 32 products are summed exactly in int32 (maddubs, VNNI's
    vpdpbusd, AMX's tiles from 2 rows on) and the fp32 steps after it are the same per (weight
    row, x row) on every path: each variant gives these floats at every row count, bit for bit."""
    generator = torch.Generator().manual_seed(7)
    n, k = 300, 4928  # a last block of 12 weight rows; 154 chunks: not whole groups of 4
    weight = torch.randn(n, k, generator=generator) / 70
    bias = torch.randn(n, generator=generator)
    x = torch.randn(37, k, generator=generator) * 2  # 37: three groups of 16 x rows on the tiles
    outputs = {}
    for variant in cpu_kernels.runnable_variants():
        kernels = cpu_kernels.load_variant(variant.name)
        if weights == "nf4":
            projection, _ = _four_bit(kernels, weight, "nf4", 64, bias, int8_x=True)
        else:
            scales = weight.view(n, -1, 64).abs().amax(-1, keepdim=True) / 127
            codes = torch.round(weight.view(n, -1, 64) / scales).to(torch.int8).view(n, k)
            projection = kernels.Projection.int8_weights(codes, scales.reshape(-1).contiguous(), 64, bias,
                                                         int8_x=True)
        outputs[variant.name] = [projection(x[:rows]) for rows in (1, 2, 3, 5, 16, 17, 37)]
    first, *others = outputs
    for name in others:
        for a, b in zip(outputs[first], outputs[name], strict=True):
            assert torch.equal(a, b), f"{weights}: {first} and {name} differ at {a.shape[0]} rows"


@pytest.mark.filterwarnings("ignore")
def test_int8_bf16_activations(ops) -> None:  # noqa: F811
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(40, 64, generator=generator) / 8
    codes, scales, state = _bnb_int8(weight, 6.0)
    projection = ops.Projection.int8(codes, scales, None, 6.0)
    for rows in (1, 3, 16, 37):  # 37: outlier sums over more than two vectors of x rows
        x = (torch.randn(rows, 64, generator=generator) * 3).bfloat16()
        x[0, 5] = 8.0
        error = _relative(projection(x), _row_by_row(lambda row: bnb.matmul(row, codes, state=state), x))
        assert error <= 2**-7, f"int8 bf16, {rows} rows: error {error}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8", "nf4-int8x"])
def test_a_rows_product_does_not_depend_on_the_other_rows(ops, kind: str, dtype: torch.dtype) -> None:  # noqa: F811
    """Each x row's output is bit for bit its product alone at 1-16 rows (one row, the few-row
    tiles, AMX's tiles): LLM.int8()'s outlier columns are decided per row (rows 3 and 9 have
    their own, row 5 one in a column row 3 shares), and a 4-bit row sums in one order however
    many rows share the product (with int8 activations: each row quantized alone, its chunk sums
    exact). A verification of k tokens therefore equals k one-token steps."""
    generator = torch.Generator().manual_seed(23)
    weight = torch.randn(37, 640, generator=generator) / 25  # 9 blocks of 4 rows and a single row
    bias = torch.randn(37, generator=generator)
    if kind == "int8":
        codes, scales, _ = _bnb_int8(weight, 6.0)
        projection = ops.Projection.int8(codes, scales, bias, 6.0)
    else:
        projection, _ = _four_bit(ops, weight, kind.split("-")[0], 64, bias.to(dtype), int8_x=kind.endswith("int8x"))
    x = (torch.randn(cpu_kernels.MAX_ROWS, 640, generator=generator) * 2).to(dtype)
    x[3, 100] = x[9, 2] = x[5, 100] = 8.0
    alone = _row_by_row(projection, x)
    for rows in range(2, cpu_kernels.MAX_ROWS + 1):
        out = projection(x[:rows])
        assert torch.equal(out, alone[:rows]), f"{ops.variant} {kind} {dtype}: {rows} rows differ from one at a time"


def test_refusals_name_the_bad_argument(ops) -> None:  # noqa: F811
    codes, absmax, table = torch.zeros(64, dtype=torch.uint8), torch.ones(4), torch.zeros(16)
    with pytest.raises(RuntimeError, match="k = 48 must be a multiple of 32"):
        ops.Projection.four_bit(torch.zeros(48, dtype=torch.uint8), torch.ones(3), table, 32, 2, 48, None)
    with pytest.raises(RuntimeError, match="blocksize 48 must be a power of two"):
        ops.Projection.four_bit(codes, absmax, table, 48, 2, 64, None)
    with pytest.raises(RuntimeError, match="codes must be n \\* k / 2 contiguous uint8 values, got 64 for \\[4, 64\\]"):
        ops.Projection.four_bit(codes, absmax, table, 32, 4, 64, None)
    with pytest.raises(RuntimeError, match="absmax must hold one fp32 value per block of 32"):
        ops.Projection.four_bit(codes, torch.ones(3), table, 32, 2, 64, None)
    with pytest.raises(RuntimeError, match="table must hold 16 fp32 values"):
        ops.Projection.four_bit(codes, absmax, torch.zeros(8), 32, 2, 64, None)
    with pytest.raises(RuntimeError, match="bias has 3 values, weight 2 rows"):
        ops.Projection.four_bit(codes, absmax, table, 32, 2, 64, torch.zeros(3))
    with pytest.raises(RuntimeError, match="codes \\(CB\\) must be a contiguous int8"):
        ops.Projection.int8(torch.zeros(2, 4), torch.ones(2), None, 6.0)
    with pytest.raises(RuntimeError, match="scales \\(SCB\\) must hold one fp32 value per row"):
        ops.Projection.int8(torch.zeros(2, 4, dtype=torch.int8), torch.ones(3), None, 6.0)
    projection = ops.Projection.int8(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2), None, 6.0)
    with pytest.raises(RuntimeError, match="x must be \\[m, 4\\]"):
        projection(torch.zeros(1, 5))
    with pytest.raises(RuntimeError, match="dtype Half is not supported"):
        projection(torch.zeros(1, 4).half())
    with pytest.raises(RuntimeError, match="weight must be a contiguous \\[n, k\\]"):
        ops.Projection.dense(torch.zeros(4, 2).T, None)


@pytest.mark.parametrize(("n", "k", "blocksize"), [(1, 32, 32), (5, 128, 64), (129, 576, 64), (3, 256, 256)])
def test_int8_weights_equal_the_dequantized_product(ops, n: int, k: int, blocksize: int) -> None:  # noqa: F811
    """Weight-only int8 in blocks (the int8 lm_head): x stays fp32, w = code * scale[block]; with
    int8_x, x as int8 per 32 values (test_four_bit_with_int8_activations_follows_its_definition),
    and each row's product still its product alone."""
    generator = torch.Generator().manual_seed(n * 7 + k)
    blocks = torch.randn(n, k // blocksize, blocksize, generator=generator)
    scales = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(blocks / scales).to(torch.int8).view(n, k)
    bias = torch.randn(n, generator=generator)
    projection = ops.Projection.int8_weights(codes, scales.reshape(-1).contiguous(), blocksize, bias)
    quantized_x = ops.Projection.int8_weights(codes, scales.reshape(-1).contiguous(), blocksize, bias, int8_x=True)
    dense = (codes.double().view(n, -1, blocksize) * scales.double()).view(n, k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=generator)
        error = _relative(projection(x), x.double() @ dense.T + bias.double())
        assert error <= 1e-5, f"int8 weights [{n}, {k}] blocksize {blocksize}, {rows} rows: error {error}"
        out = quantized_x(x)
        error = _relative(out, _int8_rows(x) @ dense.T + bias.double())
        assert error <= 1e-6, f"int8 weights, int8 x [{n}, {k}] blocksize {blocksize}, {rows} rows: error {error}"
        if rows <= cpu_kernels.MAX_ROWS:
            assert torch.equal(out, _row_by_row(quantized_x, x)), f"int8 weights, int8 x: {rows} rows"
    with pytest.raises(RuntimeError, match="blocksize 48 must be a power of two >= 32 dividing k = 96"):
        ops.Projection.int8_weights(torch.zeros(2, 96, dtype=torch.int8), torch.ones(4), 48, None)


@pytest.mark.parametrize("weights", ["nf4", "int8 blocks"])
def test_int8_activations_carry_a_nan_to_its_row_alone(ops, weights: str) -> None:  # noqa: F811
    """A NaN in an x row makes that row's outputs NaN, as fp32 products would (rounding x to int8
    alone would drop it: max|x| ignores NaN), and leaves the other rows as they are alone."""
    generator = torch.Generator().manual_seed(31)
    weight = torch.randn(9, 128, generator=generator) / 8
    if weights == "nf4":
        projection, _ = _four_bit(ops, weight, "nf4", 64, None, int8_x=True)
    else:
        scales = weight.view(9, 2, 64).abs().amax(-1, keepdim=True) / 127
        codes = torch.round(weight.view(9, 2, 64) / scales).to(torch.int8).view(9, 128)
        projection = ops.Projection.int8_weights(codes, scales.reshape(-1).contiguous(), 64, None, int8_x=True)
    x = torch.randn(3, 128, generator=generator)
    x[1, 70] = float("nan")
    out = projection(x)
    assert out[1].isnan().all(), f"{weights}: the NaN row gave {out[1]}"
    assert torch.equal(out[[0, 2]], projection(x[[0, 2]])), f"{weights}: the NaN changed the other rows"
