// Linear layers for the few-row case of decoding: y[m, n] = x[m, k] @ W[n, k]^T (+ bias).
//
// Design note: at decode time m (rows x new tokens) is 1..16 while W is read whole from
// memory, so the cost is the weight stream. Generic GEMMs tile for large m and, on this
// machine, run a bf16 matrix-vector product at half the memory bandwidth and an 8-row fp32
// product 2.5x slower than a 1-row one. Here each block of R weight rows is loaded once and
// multiplied with every x row while it sits in registers and L1, so m rows cost about what
// one row costs. bf16 weights use the AVX512-BF16 pair dot product (fp32 accumulation, as
// torch's bf16 linear accumulates); fp32 weights use FMA. Output rows are split across
// torch's own OpenMP team (at::parallel_for), so no second thread pool competes for cores.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 16;  // larger m goes to torch (see small_m_linear.py)
constexpr int kTile = 4;          // x rows per register tile

// Sixteen horizontal sums at once: lane 4*j + r of the result is the sum of acc[4*r + j].
// (A transpose-and-add tree: 45 instructions instead of 16 separate reductions of ~8 each.)
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 s[8], u[4], w[2];
  for (int p = 0; p < 8; ++p)  // blocks 0,1: partials of v[2p]; blocks 2,3: of v[2p+1]
    s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)  // block t: four partials of v[4q + t]
    u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xDD));
  for (int h = 0; h < 2; ++h)  // block t: two partials each of v[8h + t], v[8h + 4 + t]
    w[h] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * h], u[2 * h + 1]), _mm512_unpackhi_ps(u[2 * h], u[2 * h + 1]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // block t = [v[t], v[4+t], v[8+t], v[12+t]]
}

// Writes acc[r][j] (+ bias) to y[m0 + j, row + r]; R is 1 (tail rows) or 4.
template <int R, int MT, typename Out>
inline void store(const __m512 (&acc)[R][MT], Out* y, int64_t n, int64_t m0, int64_t row, const float* bias) {
  if constexpr (R == 4) {
    __m512 v[16];
    for (int r = 0; r < 4; ++r)
      for (int j = 0; j < 4; ++j) v[4 * r + j] = j < MT ? acc[r][j] : _mm512_setzero_ps();
    __m512 sums = reduce16(v);  // block j = y[m0 + j, row .. row + 3]
    if (bias) sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(bias + row)));
    alignas(64) float out[16];
    _mm512_store_ps(out, sums);
    for (int j = 0; j < MT; ++j)
      for (int r = 0; r < 4; ++r) y[(m0 + j) * n + row + r] = static_cast<Out>(out[4 * j + r]);
  } else {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < MT; ++j)
        y[(m0 + j) * n + row + r] = static_cast<Out>(_mm512_reduce_add_ps(acc[r][j]) + (bias ? bias[row + r] : 0.0f));
  }
}

// ---- fp32 weights, fp32 activations -------------------------------------------------------
template <int R, int MT>
inline void block_f32(const float* w, int64_t k, const float* x, int64_t m0, float* y, int64_t n,
                      int64_t row, const float* bias) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_loadu_ps(w + (row + r) * k + c);
      // The next block's rows: R short streams confuse the hardware prefetcher.
      _mm_prefetch(reinterpret_cast<const char*>(w + (row + R + r) * k + c), _MM_HINT_T0);
    }
    for (int j = 0; j < MT; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + j) * k + c);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]);
    }
  }
  if (c < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - c)) - 1u);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + (row + r) * k + c);
    for (int j = 0; j < MT; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + j) * k + c);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]);
    }
  }
  store<R, MT>(acc, y, n, m0, row, bias);
}

// ---- bf16 weights, bf16 activations --------------------------------------------------------
template <int R, int MT>
inline void block_bf16(const uint16_t* w, int64_t k, const uint16_t* x, int64_t m0, c10::BFloat16* y,
                       int64_t n, int64_t row, const float* bias) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    __m512i wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_loadu_si512(w + (row + r) * k + c);
      _mm_prefetch(reinterpret_cast<const char*>(w + (row + R + r) * k + c), _MM_HINT_T0);
    }
    for (int j = 0; j < MT; ++j) {
      const __m512i xv = _mm512_loadu_si512(x + (m0 + j) * k + c);
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  if (c < k) {
    const __mmask32 mask = static_cast<__mmask32>((1u << (k - c)) - 1u);
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, w + (row + r) * k + c);
    for (int j = 0; j < MT; ++j) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + (m0 + j) * k + c);
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  store<R, MT>(acc, y, n, m0, row, bias);
}

// Rows [row0, row1) of W against every x row, in register tiles of kTile x rows.
template <typename Block1, typename Block4>
inline void run_rows(int64_t row0, int64_t row1, int64_t m, Block1 one_row, Block4 four_rows) {
  int64_t row = row0;
  for (; row + 4 <= row1; row += 4) four_rows(row, m);
  for (; row < row1; ++row) one_row(row, m);
}

#define DISPATCH_TILE(BLOCK, R, ...)                                              \
  for (int64_t m0 = 0; m0 < m; m0 += kTile) {                                   \
    switch (std::min<int64_t>(kTile, m - m0)) {                                  \
      case 1: BLOCK<R, 1>(__VA_ARGS__); break;                                   \
      case 2: BLOCK<R, 2>(__VA_ARGS__); break;                                   \
      case 3: BLOCK<R, 3>(__VA_ARGS__); break;                                   \
      default: BLOCK<R, 4>(__VA_ARGS__); break;                                  \
    }                                                                            \
  }

torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& weight,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_m_linear: x and weight must be 2-D");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_m_linear: x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "small_m_linear: x is ", x.scalar_type(),
              " but weight is ", weight.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "small_m_linear: x has ", k, " features, weight ", weight.size(1));
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "small_m_linear: ", m, " rows; at most ", kMaxRows);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == n, "small_m_linear: bias has ", bias->numel(), " values, weight ", n, " rows");
  // Biases are added in fp32 before rounding, once per output.
  const torch::Tensor bias32 = has_bias ? bias->to(torch::kFloat).contiguous() : torch::Tensor();
  const float* bp = has_bias ? bias32.data_ptr<float>() : nullptr;
  auto y = torch::empty({m, n}, x.options());
  const int64_t blocks = (n + 3) / 4;
  // ~64 KiB of weights per task: small matrices still split across both cores.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (4 * k * weight.element_size()));
  if (x.scalar_type() == torch::kFloat) {
    const float* w = weight.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      run_rows(b0 * 4, std::min(n, b1 * 4), m,
               [&](int64_t row, int64_t m) { DISPATCH_TILE(block_f32, 1, w, k, xp, m0, yp, n, row, bp) },
               [&](int64_t row, int64_t m) { DISPATCH_TILE(block_f32, 4, w, k, xp, m0, yp, n, row, bp) });
    });
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "small_m_linear: dtype ", x.scalar_type(),
                " is not supported (float32, bfloat16)");
    const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    auto* yp = y.data_ptr<c10::BFloat16>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      run_rows(b0 * 4, std::min(n, b1 * 4), m,
               [&](int64_t row, int64_t m) { DISPATCH_TILE(block_bf16, 1, w, k, xp, m0, yp, n, row, bp) },
               [&](int64_t row, int64_t m) { DISPATCH_TILE(block_bf16, 4, w, k, xp, m0, yp, n, row, bp) });
    });
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("small_m_linear", &small_m_linear, "y = x @ weight.T (+ bias) for 1..16 rows of x");
  module.attr("max_rows") = kMaxRows;
}
