// Dense few-row products on the formats of blocks.h: fp32 weights (FMA), bf16 weights (widened
// by a shift, the AVX-512 BF16 pair dot product in the avx512_bf16 variant, or AMX tiles in the
// amx variant: amx.h), and weight-only int8 in blocks. See blocks.h for the design.
#include <cstring>

#include "amx.h"
#include "blocks.h"
#include "kernels.h"

namespace tgi {
namespace {

using blocks::Bf16Weights;
using blocks::F32Weights;
using blocks::Prepared;
using simd::F;

// Weight-only int8 in blocks: w = code * scale[block] with blocks of 2^shift weights along k
// (within rows); codes widened to fp32 (exact) and scaled per chunk, x used in fp32 as it is.
struct Int8Weights {
  using X = float;
  static constexpr int64_t kChunk = 2 * simd::kLanes;
  static constexpr int kMaxTile = 4;  // AVX-512: 4 x 4 sums + 8 weight vectors (AVX2: kTileLimit, 2)
  static constexpr int kTallTile = 5;  // AVX2, pairs of weight rows: 10 sums + 4 weights + x
  static constexpr int kWideTile = 0;  // blocks::wide_rows: x rows in fp32, as F32Weights
  struct Vals { F lo, hi; };
  const int8_t* w;
  const float* scales;  // one per block
  int shift;            // log2(blocksize), blocksize a multiple of kChunk
  int64_t k;

  static Vals widen(const int8_t* p) {
#if defined(__AVX512F__)
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)))};
#else
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
#endif
  }
  Vals load(int64_t row, int64_t c) const {
    const Vals v = widen(w + row * k + c);
    const F scale = simd::set1(scales[(row * k + c) >> shift]);
    return {simd::mul(v.lo, scale), simd::mul(v.hi, scale)};
  }
  Vals load_tail(int64_t, int64_t, int64_t) const { return {simd::zero(), simd::zero()}; }  // k % blocksize == 0
  void prefetch(int64_t row, int64_t c) const { simd::prefetch_ahead(w + row * k + c); }
  int64_t row_bytes(int64_t k_) const { return k_; }
  static F madd(F acc, const Vals& v, const float* x) {
    return simd::fmadd(v.hi, simd::load(x + simd::kLanes), simd::fmadd(v.lo, simd::load(x), acc));
  }
  static Prepared<float> prepare(const float* x, int64_t m, int64_t k_) {  // natural order
    Prepared<float> out(m, k_, kChunk);
    for (int64_t j = 0; j < m; ++j) std::memcpy(out.row(j), x + j * k_, k_ * sizeof(float));
    return out;
  }
};

}  // namespace

void linear_int8_weights(const float* x, const int8_t* w, const float* scales, int64_t blocksize, const float* bias,
                         float* y, int64_t m, int64_t k, int64_t n) {
  const Int8Weights weights{w, scales, __builtin_ctzll(blocksize), k};
  blocks::run(weights, Int8Weights::prepare(x, m, k), m, k, n, bias, y);
}

const char* variant_name() { return TGI_VARIANT; }

void linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t k, int64_t n) {
  const F32Weights weights{w, k};
  blocks::run(weights, F32Weights::prepare(x, m, k), m, k, n, bias, y);
}

void linear_bf16(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t m, int64_t k,
                 int64_t n) {
#if defined(TGI_AMX)
  if (amx::permitted()) {
    amx::bf16(x, w, m, k, n, bias, y);
    return;
  }
#endif
  const Bf16Weights weights{w, k};
  blocks::run(weights, Bf16Weights::prepare(x, m, k), m, k, n, bias, y);
}

}  // namespace tgi
