// CPU kernels of the fast runner's decode step (see cpu_kernels.py for how they are built).
//
// 1. small_m_linear: y[m, n] = x[m, k] @ W[n, k]^T (+ bias) for the few-row case of decoding.
// 2. rms_norm: one pass per row instead of torch's ~8 ops (pow, mean, add, rsqrt, mul, casts).
// 3. decode_attention: one new query per row against the cache, in place of SDPA, whose CPU
//    flash kernel costs ~50 us per call at these sizes.
// 4. rope: x * cos + roll(x, dim / 2) * signed_sin (rope.py's convention) in one pass.
// 5. silu_mul: silu(gate) * up from the fused gate/up output, without the chunk views.
// 6. decode_layer: a whole Llama-family decoder layer for one new token per row, composed of
//    the above, so a decode step crosses from Python once per layer instead of ~25 times.
// Elementwise code is compiled with -ffp-contract=off: a fused multiply-add rounds once where
// torch rounds twice, and one ulp per element grows past the 1e-4 logits parity budget.
//
// Design note (small_m_linear): at decode time m (rows x new tokens) is 1..16 while W is read
// whole from memory, so the cost is the weight stream. Generic GEMMs tile for large m and, on this
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 16;  // larger m goes to torch (fast_llama.linear, project below)
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

// ---- one block of weight rows against a tile of x rows --------------------------------------
// The two weight types differ only in how a vector is loaded and multiplied into fp32 sums.
struct Fp32 {  // FMA on 16 floats
  using T = float;
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static Vec load(Mask mask, const T* p) { return _mm512_maskz_loadu_ps(mask, p); }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

struct Bf16 {  // pair dot products on 32 bf16 values, fp32 accumulation
  using T = uint16_t;
  using Vec = __m512i;
  using Mask = __mmask32;
  static constexpr int64_t kLanes = 32;
  static Vec load(Mask mask, const T* p) { return _mm512_maskz_loadu_epi16(mask, p); }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
};

// y[m0 .. m0 + MT, row .. row + R] = x rows . W rows (+ bias); the last chunk of k is masked.
template <typename E, int R, int MT, typename Out>
inline void block(const typename E::T* w, int64_t k, const typename E::T* x, int64_t m0, Out* y, int64_t n,
                  int64_t row, const float* bias) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += E::kLanes) {
    const auto mask = static_cast<typename E::Mask>(
        c + E::kLanes <= k ? ~uint64_t{0} : (uint64_t{1} << (k - c)) - 1u);
    typename E::Vec wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = E::load(mask, w + (row + r) * k + c);
      // The next block's rows: R short streams confuse the hardware prefetcher. (Past the
      // last row this names memory outside W: prefetches are hints and never fault.)
      _mm_prefetch(reinterpret_cast<const char*>(w + (row + R + r) * k + c), _MM_HINT_T0);
    }
    for (int j = 0; j < MT; ++j) {
      const typename E::Vec xv = E::load(mask, x + (m0 + j) * k + c);
      for (int r = 0; r < R; ++r) acc[r][j] = E::madd(acc[r][j], wv[r], xv);
    }
  }
  store<R, MT>(acc, y, n, m0, row, bias);
}

// Rows of W split across torch's threads; each task runs blocks of 4 rows (then single rows)
// against every x row, in register tiles of kTile x rows.
template <typename E, typename Out>
void run_blocks(const typename E::T* w, const typename E::T* x, Out* y, int64_t m, int64_t k, int64_t n,
                const float* bias) {
  const int64_t blocks = (n + 3) / 4;
  // ~64 KiB of weights per task: small matrices still split across both cores.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (4 * k * static_cast<int64_t>(sizeof(typename E::T))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t end = std::min(n, b1 * 4);
    for (int64_t row = b0 * 4; row < end;) {
      const bool four = row + 4 <= end;
      for (int64_t m0 = 0; m0 < m; m0 += kTile) {
        const int64_t tile = std::min<int64_t>(kTile, m - m0);
#define TGI_BLOCK(R, MT) block<E, R, MT>(w, k, x, m0, y, n, row, bias)
        if (four) {
          switch (tile) { case 1: TGI_BLOCK(4, 1); break; case 2: TGI_BLOCK(4, 2); break;
                          case 3: TGI_BLOCK(4, 3); break; default: TGI_BLOCK(4, 4); }
        } else {
          switch (tile) { case 1: TGI_BLOCK(1, 1); break; case 2: TGI_BLOCK(1, 2); break;
                          case 3: TGI_BLOCK(1, 3); break; default: TGI_BLOCK(1, 4); }
        }
#undef TGI_BLOCK
      }
      row += four ? 4 : 1;
    }
  });
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
  if (x.scalar_type() == torch::kFloat) {
    run_blocks<Fp32>(weight.data_ptr<float>(), x.data_ptr<float>(), y.data_ptr<float>(), m, k, n, bp);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "small_m_linear: dtype ", x.scalar_type(),
                " is not supported (float32, bfloat16)");
    run_blocks<Bf16>(reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()),
                     reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), y.data_ptr<c10::BFloat16>(),
                     m, k, n, bp);
  }
  return y;
}

// ---- RMSNorm ---------------------------------------------------------------------------------
template <typename T>
inline float as_float(T value) { return static_cast<float>(value); }

// y = (x * rsqrt(mean(x^2) + eps)) * w, in fp32, rounded once to T (transformers' order for fp32).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      double squares = 0.0;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) squares += static_cast<double>(as_float(xr[i])) * as_float(xr[i]);
      const float variance = static_cast<float>(squares / static_cast<double>(d));
      const float scale = 1.0f / std::sqrt(variance + eps);
      for (int64_t i = 0; i < d; ++i) {
        const float normed = as_float(xr[i]) * scale;
        yr[i] = static_cast<T>(normed * as_float(w[i]));
      }
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x is ", x.scalar_type(), " but weight is ",
              weight.scalar_type());
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d, "rms_norm: x has ", d, " features, weight ", weight.numel());
  auto y = torch::empty_like(x);
  const int64_t rows = d ? x.numel() / d : 0;
  if (x.scalar_type() == torch::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, d, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rms_norm: dtype ", x.scalar_type(),
                " is not supported (float32, bfloat16)");
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows,
                  d, static_cast<float>(eps));
  }
  return y;
}

// ---- attention of one new query per row ------------------------------------------------------
// q [rows, 1, heads, dim], keys/values [rows, kv_heads, total, dim] (any strides but the last),
// mask [rows, 1, 1, total] additive; returns [rows, 1, heads * dim]. Query head h reads kv head
// h / (heads / kv_heads). fp32 scores, softmax and sums, as SDPA's CPU kernel accumulates.
template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                           const torch::Tensor& mask, float scale, torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(2), dim = q.size(3);
  const int64_t kv_heads = keys.size(1), total = keys.size(2), group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const T* mp = mask.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs2 = q.stride(2);
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, total * dim));
  at::parallel_for(0, rows * heads, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(total), query(dim), acc(dim);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t r = task / heads, h = task % heads, g = h / group;
      for (int64_t i = 0; i < dim; ++i) query[i] = as_float(qp[r * qs0 + h * qs2 + i]);
      const T* kr = kp + r * ks0 + g * ks1;
      const T* vr = vp + r * vs0 + g * vs1;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < total; ++t) {
        const T* kt = kr + t * ks2;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; ++i) dot += query[i] * as_float(kt[i]);
        scores[t] = dot * scale + as_float(mp[r * total + t]);
        best = std::max(best, scores[t]);
      }
      float sum = 0.0f;
      for (int64_t t = 0; t < total; ++t) {
        scores[t] = std::exp(scores[t] - best);
        sum += scores[t];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < total; ++t) {
        const T* vt = vr + t * vs2;
        const float p = scores[t];
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) acc[i] += p * as_float(vt[i]);
      }
      T* o = op + (r * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = static_cast<T>(acc[i] / sum);
    }
  });
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(1) == 1, "decode_attention: q must be [rows, 1, heads, dim], got ", q.sizes());
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(), "decode_attention: keys ", keys.sizes(),
              " and values ", values.sizes(), " must both be [rows, kv_heads, total, dim]");
  TORCH_CHECK(keys.size(0) == q.size(0) && keys.size(3) == q.size(3) && q.size(2) % keys.size(1) == 0,
              "decode_attention: q ", q.sizes(), " does not fit keys ", keys.sizes());
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "decode_attention: the last dimension of q, keys and values must be contiguous");
  TORCH_CHECK(mask.is_contiguous() && mask.numel() == keys.size(0) * keys.size(2),
              "decode_attention: mask must be a contiguous [rows, 1, 1, total] tensor");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type() &&
              q.scalar_type() == mask.scalar_type(), "decode_attention: q, keys, values and mask must share a dtype");
  auto out = torch::empty({q.size(0), 1, q.size(2) * q.size(3)}, q.options());
  if (q.scalar_type() == torch::kFloat) {
    decode_attention_impl<float>(q, keys, values, mask, static_cast<float>(scale), out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "decode_attention: dtype ", q.scalar_type(),
                " is not supported (float32, bfloat16)");
    decode_attention_impl<c10::BFloat16>(q, keys, values, mask, static_cast<float>(scale), out);
  }
  return out;
}

// ---- RoPE and the gated activation -----------------------------------------------------------
// x [rows, new, heads, dim] (the q/k heads of the fused projection: a view, last dim
// contiguous); cos/sin [rows, new, 1, dim] contiguous; y contiguous. fp32 math, the two
// products and the sum each rounded as torch rounds them (no contraction, see the header).
template <typename T>
void rope_impl(const T* x, int64_t token_stride, int64_t head_stride, const T* cos, const T* sin, T* y,
               int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * dim;
    const T* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + t * token_stride + h * head_stride;
      T* yr = y + (t * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float rotated = as_float(xr[i < half ? i + half : i - half]);
        const float a = as_float(xr[i]) * as_float(c[i]);
        const float b = rotated * as_float(s[i]);
        yr[i] = static_cast<T>(a + b);
      }
    }
  }
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && (x.size(0) == 1 || x.stride(0) == x.size(1) * x.stride(1)),
              "rope: x must be [rows, new, heads, dim] with rows and tokens evenly strided, got ", x.sizes(),
              " strides ", x.strides());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(1) * x.size(3) &&
              sin.numel() == cos.numel(), "rope: cos and sin must be contiguous [rows, new, 1, dim] tensors");
  TORCH_CHECK(x.size(3) % 2 == 0, "rope: head dim ", x.size(3), " is odd");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
              "rope: x, cos and sin must share a dtype");
  auto y = torch::empty(x.sizes(), x.options());
  const int64_t tokens = x.size(0) * x.size(1), heads = x.size(2), dim = x.size(3);
  if (x.scalar_type() == torch::kFloat) {
    rope_impl(x.data_ptr<float>(), x.stride(1), x.stride(2), cos.data_ptr<float>(), sin.data_ptr<float>(),
              y.data_ptr<float>(), tokens, heads, dim);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rope: dtype ", x.scalar_type(), " is not supported");
    rope_impl(x.data_ptr<c10::BFloat16>(), x.stride(1), x.stride(2), cos.data_ptr<c10::BFloat16>(),
              sin.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), tokens, heads, dim);
  }
  return y;
}

// gate_up [..., 2 * inner] contiguous -> silu(gate) * up [..., inner]; silu(g) = g / (1 + exp(-g)).
template <typename T>
void silu_mul_impl(const T* gate_up, T* y, int64_t tokens, int64_t inner) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = gate_up + t * 2 * inner;
    const T* u = g + inner;
    T* yr = y + t * inner;
    for (int64_t i = 0; i < inner; ++i) {
      const float gate = as_float(g[i]);
      const float act = static_cast<float>(static_cast<T>(gate / (1.0f + std::exp(-gate))));
      yr[i] = static_cast<T>(act * as_float(u[i]));
    }
  }
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up must be contiguous with an even last dimension, got ", gate_up.sizes());
  auto sizes = gate_up.sizes().vec();
  const int64_t inner = sizes.back() / 2;
  sizes.back() = inner;
  auto y = torch::empty(sizes, gate_up.options());
  const int64_t tokens = inner ? y.numel() / inner : 0;
  if (gate_up.scalar_type() == torch::kFloat) {
    silu_mul_impl(gate_up.data_ptr<float>(), y.data_ptr<float>(), tokens, inner);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "silu_mul: dtype ", gate_up.scalar_type(),
                " is not supported");
    silu_mul_impl(gate_up.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), tokens, inner);
  }
  return y;
}

// ---- one decoder layer, one new token per row --------------------------------------------------
c10::optional<torch::Tensor> present(const c10::optional<torch::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias : c10::nullopt;
}

// cache[:, :, column] = src ([rows, kv_heads, dim], last dim contiguous), by rows of dim values:
// torch's strided copy_ costs ~7 us here, this well under one.
void write_column(const torch::Tensor& cache, int64_t column, const torch::Tensor& src) {
  TORCH_CHECK(cache.stride(3) == 1 && src.stride(2) == 1 && cache.scalar_type() == src.scalar_type() &&
              src.size(0) == cache.size(0) && src.size(1) == cache.size(1) && src.size(2) == cache.size(3),
              "decode_layer: cache ", cache.sizes(), " does not fit the new keys/values ", src.sizes());
  const int64_t row_bytes = src.size(2) * src.element_size();
  auto* base = static_cast<char*>(cache.data_ptr());
  const auto* from = static_cast<const char*>(src.data_ptr());
  for (int64_t r = 0; r < src.size(0); ++r)
    for (int64_t g = 0; g < src.size(1); ++g)
      std::memcpy(base + (r * cache.stride(0) + g * cache.stride(1) + column * cache.stride(2)) * cache.element_size(),
                  from + (r * src.stride(0) + g * src.stride(1)) * src.element_size(), row_bytes);
}

// The kernel up to kMaxRows rows (as fast_llama.linear decides), torch's GEMM beyond.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  return x.size(0) <= kMaxRows ? small_m_linear(x, weight, present(bias)) : at::linear(x, weight, present(bias));
}

// h [rows, 1, hidden]; k_cache/v_cache [rows, kv_heads, capacity, dim] whole buffers, column
// `length` is written; cos/sin [rows, 1, 1, dim]; mask [rows, 1, 1, length + 1]. Same math and
// rounding steps as fast_llama.pre_attention/post_attention for the Llama family.
torch::Tensor decode_layer(const torch::Tensor& h, const torch::Tensor& in_norm, const torch::Tensor& qkv,
                           const c10::optional<torch::Tensor>& qkv_bias, const torch::Tensor& o_proj,
                           const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& mlp_norm,
                           const torch::Tensor& gate_up, const c10::optional<torch::Tensor>& gate_up_bias,
                           const torch::Tensor& down, const c10::optional<torch::Tensor>& down_bias,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t length,
                           const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& mask,
                           int64_t heads, int64_t kv_heads, double eps, double scale) {
  TORCH_CHECK(h.dim() == 3 && h.size(1) == 1 && h.is_contiguous(), "decode_layer: h must be a contiguous [rows, 1, hidden]");
  TORCH_CHECK(length >= 0 && length < k_cache.size(2), "decode_layer: column ", length, " is outside the cache's ",
              k_cache.size(2));
  const int64_t rows = h.size(0), hidden = h.size(2), dim = k_cache.size(3);
  auto qkv_out = project(rms_norm(h, in_norm, eps).view({rows, hidden}), qkv, qkv_bias)
                     .view({rows, 1, heads + 2 * kv_heads, dim});
  auto qk = rope(qkv_out.narrow(2, 0, heads + kv_heads), cos, sin);  // [rows, 1, heads + kv, dim]
  write_column(k_cache, length, qk.select(1, 0).narrow(1, heads, kv_heads));
  write_column(v_cache, length, qkv_out.select(1, 0).narrow(1, heads + kv_heads, kv_heads));
  auto attn = decode_attention(qk.narrow(2, 0, heads), k_cache.narrow(2, 0, length + 1),
                               v_cache.narrow(2, 0, length + 1), mask, scale);  // [rows, 1, heads * dim]
  auto h2 = h + project(attn.view({rows, heads * dim}), o_proj, o_bias).view({rows, 1, hidden});
  auto act = silu_mul(project(rms_norm(h2, mlp_norm, eps).view({rows, hidden}), gate_up, gate_up_bias));
  return h2 + project(act, down, down_bias).view({rows, 1, hidden});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("small_m_linear", &small_m_linear, "y = x @ weight.T (+ bias) for 1..16 rows of x");
  module.def("rms_norm", &rms_norm, "transformers' RMSNorm in one pass (fp32 math)");
  module.def("decode_attention", &decode_attention, "attention of one new query per row against the cache");
  module.def("rope", &rope, "x * cos + roll(x, dim / 2) * signed_sin");
  module.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up output");
  module.def("decode_layer", &decode_layer, "one Llama-family decoder layer for one new token per row");
  module.attr("max_rows") = kMaxRows;
}
