// RMSNorm, RoPE, silu(gate) * up, residual adds and bf16 conversions: one pass each instead of torch ops.
//
// Compiled with -ffp-contract=off: a fused multiply-add rounds once where torch rounds twice,
// and one ulp per element grows past the fast runner's 1e-4 logits parity budget. Every step
// below rounds where transformers' modules round (fp32 math, one rounding to T at the end).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"
#include "simd.h"

namespace tgi {
namespace {

inline float as_float(float value) { return value; }
inline float as_float(uint16_t value) { return simd::from_bf16(value); }

template <typename T>
inline T from_float(float value) {
  if constexpr (sizeof(T) == 2) {
    return simd::to_bf16(value);
  } else {
    return value;
  }
}

}  // namespace

// y = (x * rsqrt(mean(x^2) + eps)) * w, in fp32, rounded once to T.
template <typename T>
void rms_norm(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, d)), [&](int64_t r0, int64_t r1) {
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
        yr[i] = from_float<T>(normed * as_float(w[i]));
      }
    }
  });
}

// x [tokens, heads, dim] with the given strides (the q/k heads of the fused projection: a view);
// cos/sin [tokens, dim] contiguous; y contiguous. x * cos + roll(x, dim / 2) * signed_sin with
// the two products and the sum each rounded as torch rounds them.
template <typename T>
void rope(const T* x, int64_t token_stride, int64_t head_stride, const T* cos, const T* sin, T* y, int64_t tokens,
          int64_t heads, int64_t dim) {
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
        yr[i] = from_float<T>(a + b);
      }
    }
  }
}

inline simd::F load_lanes(const float* x) { return simd::load(x); }
inline simd::F load_lanes(const uint16_t* x) { return simd::load_bf16(x); }

// `count` (<= kLanes) values of v to y, rounded to T as from_float rounds them.
template <typename T>
inline void store_lanes(T* y, simd::F v, int64_t count) {
  if (count == simd::kLanes) {
    if constexpr (sizeof(T) == 4) {
      return simd::store(y, v);
    } else {
      return simd::store_bf16(y, v);
    }
  }
  alignas(64) float out[simd::kLanes];
  simd::store(out, v);
  for (int64_t j = 0; j < count; ++j) y[j] = from_float<T>(out[j]);
}

// gate_up [tokens, 2 * inner] -> silu(gate) * up [tokens, inner]; silu(g) = g / (1 + exp(-g)),
// rounded to T before the product as torch's F.silu(gate) * up is. Vectorized with simd::exp
// (torch's own silu uses a vectorized exp as well; both are within 2 ulp of expf). Whole vectors
// are read and written in place; only the last, short one goes through a zero-padded copy
// (every vector through copies cost 3.6 us a token at the default model's 1536: 0.02 of its step
// in a 5-token verification).
template <typename T>
inline simd::F silu_times(const T* g, const T* u) {
  const simd::F gate = load_lanes(g), up = load_lanes(u);
  simd::F act = simd::div(gate, simd::add(simd::set1(1.0f), simd::exp(simd::mul(gate, simd::set1(-1.0f)))));
  if constexpr (sizeof(T) == 2) act = simd::round_to_bf16(act);
  return simd::mul(act, up);
}

template <typename T>
void silu_mul(const T* gate_up, T* y, int64_t tokens, int64_t inner) {
  constexpr int64_t L = simd::kLanes;
  const int64_t whole = inner / L * L;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = gate_up + t * 2 * inner;
    const T* u = g + inner;
    T* yr = y + t * inner;
    for (int64_t i = 0; i < whole; i += L) store_lanes(yr + i, silu_times(g + i, u + i), L);
    if (whole < inner) {
      alignas(64) T gates[L] = {}, ups[L] = {};  // a zero-padded copy of the last, short vector
      std::memcpy(gates, g + whole, (inner - whole) * sizeof(T));
      std::memcpy(ups, u + whole, (inner - whole) * sizeof(T));
      store_lanes(yr + whole, silu_times(gates, ups), inner - whole);
    }
  }
}

// Whole vectors, then the tail one value at a time (each value's arithmetic is the same either way).
template <typename T>
void add(const T* a, const T* b, T* out, int64_t count) {
  const int64_t whole = count / simd::kLanes * simd::kLanes;
  for (int64_t i = 0; i < whole; i += simd::kLanes)
    store_lanes(out + i, simd::add(load_lanes(a + i), load_lanes(b + i)), simd::kLanes);
  for (int64_t i = whole; i < count; ++i) out[i] = from_float<T>(as_float(a[i]) + as_float(b[i]));
}

void widen_bf16(const uint16_t* x, float* y, int64_t count) {
  const int64_t whole = count / simd::kLanes * simd::kLanes;
  for (int64_t i = 0; i < whole; i += simd::kLanes) simd::store(y + i, simd::load_bf16(x + i));
  for (int64_t i = whole; i < count; ++i) y[i] = simd::from_bf16(x[i]);
}

void narrow_bf16(const float* x, uint16_t* y, int64_t count) {
  const int64_t whole = count / simd::kLanes * simd::kLanes;
  for (int64_t i = 0; i < whole; i += simd::kLanes) simd::store_bf16(y + i, simd::load(x + i));
  for (int64_t i = whole; i < count; ++i) y[i] = simd::to_bf16(x[i]);
}

template void rms_norm<float>(const float*, const float*, float*, int64_t, int64_t, float);
template void rms_norm<uint16_t>(const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, float);
template void rope<float>(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t, int64_t,
                          int64_t);
template void rope<uint16_t>(const uint16_t*, int64_t, int64_t, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                             int64_t, int64_t);
template void silu_mul<float>(const float*, float*, int64_t, int64_t);
template void silu_mul<uint16_t>(const uint16_t*, uint16_t*, int64_t, int64_t);
template void add<float>(const float*, const float*, float*, int64_t);
template void add<uint16_t>(const uint16_t*, const uint16_t*, uint16_t*, int64_t);

}  // namespace tgi
