// The vector primitives of one kernel variant.
//
// Design note: every variant (cpu_kernels.py: avx2, avx512, avx512_vnni, avx512_bf16) is this
// same source compiled with its own -m flags into its own module, and only the module whose
// instructions the CPU has is ever imported. The width and the instructions are chosen here,
// once per build, from the compiler's feature macros; the kernels are written once against
// these names. fp32 code never depends on a bf16 instruction: bf16 values are widened to fp32
// by a 16-bit shift (exact), and only the avx512_bf16 variant uses the bf16 dot product.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace tgi::simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using F = __m512;
using I = __m512i;

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F fmadd(F a, F b, F acc) { return _mm512_fmadd_ps(a, b, acc); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F min_(F a, F b) { return _mm512_min_ps(a, b); }
inline F max_(F a, F b) { return _mm512_max_ps(a, b); }
inline F floor_(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline F pow2_(F n) {  // 2^n for integral n in fp32 range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// kLanes contiguous bf16 values -> fp32 in order.
inline F load_bf16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline float hsum(F v) { return _mm512_reduce_add_ps(v); }
inline I load_i(const void* p) { return _mm512_loadu_si512(p); }
inline I zero_i() { return _mm512_setzero_si512(); }
inline I add_i32(I a, I b) { return _mm512_add_epi32(a, b); }
inline int32_t hsum_i32(I v) { return _mm512_reduce_add_epi32(v); }

// 2 * kLanes bf16 values -> two fp32 vectors by a 16-bit shift (exact). Within each group of 8
// values, lanes 0-3 land in `lo` and 4-7 in `hi` (the unpack works per 128-bit lane); the
// activations are widened by the same call, so the order cancels in a dot product.
inline void widen_bf16(const uint16_t* p, F& lo, F& hi) {
  const I w = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), w));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), w));
}

#else  // AVX2 + FMA (+ F16C)
constexpr int kLanes = 8;
using F = __m256;
using I = __m256i;

inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F fmadd(F a, F b, F acc) { return _mm256_fmadd_ps(a, b, acc); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F min_(F a, F b) { return _mm256_min_ps(a, b); }
inline F max_(F a, F b) { return _mm256_max_ps(a, b); }
inline F floor_(F a) { return _mm256_floor_ps(a); }
inline F pow2_(F n) {  // 2^n for integral n in fp32 range
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F load_bf16(const uint16_t* p) {  // kLanes contiguous bf16 values -> fp32 in order
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline I load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline I zero_i() { return _mm256_setzero_si256(); }
inline I add_i32(I a, I b) { return _mm256_add_epi32(a, b); }
inline int32_t hsum_i32(I v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline void widen_bf16(const uint16_t* p, F& lo, F& hi) {  // see the AVX-512 twin above
  const I w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
}

#endif

// Horizontal sums of 8-lane vectors: every variant's (AVX-512 builds use them for formats whose
// tiles keep 256-bit sums, see blocks.h).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline void hsum4(const __m256 (&v)[4], float* out) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

// Scratch vectors on 64-byte boundaries: a vector load that straddles two cache lines costs two
// (std::vector's 16-byte alignment splits 3 of 4 AVX-512 loads of the activations).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: rebinding, as allocators do
  T* allocate(std::size_t count) { return static_cast<T*>(::operator new(count * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
template <typename T>
using Buffer = std::vector<T, CacheLineAllocator<T>>;

// Weights stream from memory once per product, each thread through its own contiguous rows. The
// hardware prefetcher ramps up too slowly on the short rows of small models (2-6 KiB), and
// prefetching the next rows into L1 contends with the loads themselves; asking L2 for the line
// kAheadBytes further on each read keeps enough misses in flight: measured on a Zen 4 at 2
// threads, 20 -> 33 GB/s for a one-row fp32 product with k = 576 (a plain sum reads 28-40).
constexpr int64_t kAheadBytes = 32768;
inline void prefetch_ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kAheadBytes, _MM_HINT_T1); }

// Each lane rounded to the nearest bf16 value (ties to even), kept as fp32 (finite inputs).
inline F round_to_bf16(F v) {
#if defined(__AVX512F__)
  const I bits = _mm512_castps_si512(v);
  const I lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const I sum = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#else
  const I bits = _mm256_castps_si256(v);
  const I lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const I sum = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(sum, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
#endif
}

// e^x per lane (Cephes' single-precision polynomial: within 2 ulp of glibc's expf over the
// range; x is clamped to +-88.37, beyond which e^x is 0 or infinite in fp32 anyway).
inline F exp(F x) {
  x = min_(max_(x, set1(-88.3762626647949f)), set1(88.3762626647949f));
  const F n = floor_(fmadd(x, set1(1.44269504088896341f), set1(0.5f)));
  F r = fmadd(n, set1(-0.693359375f), x);
  r = fmadd(n, set1(2.12194440e-4f), r);
  F p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = add(fmadd(p, mul(r, r), r), set1(1.0f));
  return mul(p, pow2_(n));
}

#if defined(__AVX512F__)
// Four horizontal sums: out[r] = sum of the lanes of v[r] (the 8-lane twin is above).
inline void hsum4(const __m512 (&v)[4], float* out) {
  for (int r = 0; r < 4; ++r) out[r] = _mm512_reduce_add_ps(v[r]);
}
#endif

// fp32 -> bf16, round to nearest even (as c10::BFloat16 rounds); NaN stays NaN.
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// kLanes values stored as bf16, each rounded exactly as to_bf16 rounds it (NaN -> 0x7fc0).
inline void store_bf16(uint16_t* p, F v) {
#if defined(__AVX512F__)
  const I bits = _mm512_castps_si512(v);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const I rounded = _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_castps_si512(round_to_bf16(v)), 16), nan,
                                          _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#else
  const I bits = _mm256_castps_si256(v);
  const I nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                   _mm256_set1_epi32(0x7f800000));
  const I rounded = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_castps_si256(round_to_bf16(v)), 16),
                                       _mm256_set1_epi32(0x7fc0), nan);
  // Each lane holds 0..0xffff, so the unsigned-saturating pack keeps it; the halves stay in order.
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
#endif
}

}  // namespace tgi::simd
