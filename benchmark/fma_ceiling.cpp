// What one core of this machine can do for a few-row fp32 product, apart from the kernels'
// surroundings (threads, Python, torch): the AVX2 FMA peak, the kernels' register-tile loop
// (kernels/blocks.h: `block`) with its operands in L1 or L2, and the same loop streaming a
// weight matrix larger than the caches with and without the kernels' L2 prefetch
// (simd::prefetch_ahead, 32 KiB ahead). One thread (and two for the AVX-512 stream); best of 3
// runs per figure.
//
// Built with AVX-512F it also runs the avx512 variant's fp32 tile (4 weight rows x x rows of 16
// lanes) on the default model's hidden size, 1 and 5 x rows (a decode step and a 5-token
// verification), in L2 and streamed, so the two can be added up: whether the stream hides the
// arithmetic (streamed 5 rows cost what streamed 1 row costs) or does not (they cost the sum).
//
// Build and run (AVX2 + FMA, as the kernels' avx2 variant; add -mavx512f for the AVX-512 part):
//   g++ -O3 -mavx2 -mfma -ffp-contract=off benchmark/fma_ceiling.cpp -o /tmp/fma_ceiling && /tmp/fma_ceiling
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <thread>

namespace {

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

template <class Fn>
double best_of_3(Fn fn) {
  double best = 1e30;
  for (int run = 0; run < 3; ++run) {
    const double start = now();
    fn();
    best = std::min(best, now() - start);
  }
  return best;
}

// 12 independent FMA chains in registers: no loads, no dependences beyond each chain's own.
double peak_fmas_per_s() {
  const long iterations = 200000000L;
  const double seconds = best_of_3([&] {
    long i = iterations;
    __asm__ volatile(
        "vxorps %%ymm0,%%ymm0,%%ymm0\n vxorps %%ymm1,%%ymm1,%%ymm1\n vxorps %%ymm2,%%ymm2,%%ymm2\n"
        "vxorps %%ymm3,%%ymm3,%%ymm3\n vxorps %%ymm4,%%ymm4,%%ymm4\n vxorps %%ymm5,%%ymm5,%%ymm5\n"
        "vxorps %%ymm6,%%ymm6,%%ymm6\n vxorps %%ymm7,%%ymm7,%%ymm7\n vxorps %%ymm8,%%ymm8,%%ymm8\n"
        "vxorps %%ymm9,%%ymm9,%%ymm9\n vxorps %%ymm10,%%ymm10,%%ymm10\n vxorps %%ymm11,%%ymm11,%%ymm11\n"
        "1:\n"
        "vfmadd231ps %%ymm14,%%ymm15,%%ymm0\n vfmadd231ps %%ymm14,%%ymm15,%%ymm1\n"
        "vfmadd231ps %%ymm14,%%ymm15,%%ymm2\n vfmadd231ps %%ymm14,%%ymm15,%%ymm3\n"
        "vfmadd231ps %%ymm14,%%ymm15,%%ymm4\n vfmadd231ps %%ymm14,%%ymm15,%%ymm5\n"
        "vfmadd231ps %%ymm14,%%ymm15,%%ymm6\n vfmadd231ps %%ymm14,%%ymm15,%%ymm7\n"
        "vfmadd231ps %%ymm14,%%ymm15,%%ymm8\n vfmadd231ps %%ymm14,%%ymm15,%%ymm9\n"
        "vfmadd231ps %%ymm14,%%ymm15,%%ymm10\n vfmadd231ps %%ymm14,%%ymm15,%%ymm11\n"
        "dec %0\n jnz 1b\n"
        : "+r"(i)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "cc");
  });
  return iterations * 12.0 / seconds;
}

float sink[64];

// The kernels' tile: R weight rows loaded once per chunk of 8, each multiplied with MT x rows.
template <int R, int MT, bool kPrefetch>
__attribute__((noinline)) void tile(const float* w, const float* x, long k) {
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_ps();
  for (long c = 0; c < k; c += 8) {
    __m256 v[R];
    for (int r = 0; r < R; ++r) v[r] = _mm256_load_ps(w + r * k + c);
    if (kPrefetch)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * k + c) + 32768, _MM_HINT_T1);
    for (int j = 0; j < MT; ++j) {
      const __m256 xj = _mm256_load_ps(x + j * k + c);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(v[r], xj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) sink[r * MT + j] += acc[r][j][0];
}

constexpr long kK = 896;  // Qwen2.5-Coder-0.5B's hidden size

float* filled(long count, float value) {
  auto* p = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
  for (long i = 0; i < count; ++i) p[i] = value * static_cast<float>(i % 7);
  return p;
}

// FMAs per second of tile<R, MT> over `rows` weight rows, passed over repeatedly.
template <int R, int MT, bool kPrefetch>
double tile_fmas_per_s(const float* w, const float* x, long rows, long passes) {
  const double seconds = best_of_3([&] {
    for (long pass = 0; pass < passes; ++pass)
      for (long row = 0; row + R <= rows; row += R) tile<R, MT, kPrefetch>(w + row * kK, x, kK);
  });
  return static_cast<double>(passes) * (rows / R * R) * kK / 8 * MT / seconds;
}

template <int R, int MT, bool kPrefetch>
void report(const char* label, const float* w, const float* x, long rows, long passes, bool streamed) {
  const double fmas = tile_fmas_per_s<R, MT, kPrefetch>(w, x, rows, passes);
  const double bytes_per_s = fmas * 8 / MT * 4;  // each weight read once per tile
  std::printf("%-44s %5.2f G FMA/s", label, fmas / 1e9);
  if (streamed) std::printf("  %5.1f GB/s of weights", bytes_per_s / 1e9);
  std::printf("\n");
}

#if defined(__AVX512F__)
// The avx512 variant's tile (kernels/blocks.h: `block` on F32Weights): R weight rows of k floats,
// chunks of 16, each weight vector multiplied with MT x rows, the L2 prefetch 32 KiB ahead.
template <int R, int MT, bool kPrefetch>
__attribute__((noinline)) void tile512(const float* w, const float* x, long k, float* out = sink) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (long c = 0; c < k; c += 16) {
    __m512 v[R];
    for (int r = 0; r < R; ++r) v[r] = _mm512_load_ps(w + r * k + c);
    if (kPrefetch)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * k + c) + 32768, _MM_HINT_T1);
    for (int j = 0; j < MT; ++j) {
      const __m512 xj = _mm512_load_ps(x + j * k + c);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(v[r], xj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) out[r * MT + j] += acc[r][j][0];
}

constexpr long kK512 = 576;  // the default model's hidden size

// Milliseconds of `passes` passes of tile512<4, MT> over `rows` weight rows.
template <int MT, bool kPrefetch>
double tile512_ms(const float* w, const float* x, long rows, long passes) {
  return 1e3 * best_of_3([&] {
    for (long pass = 0; pass < passes; ++pass)
      for (long row = 0; row + 4 <= rows; row += 4) tile512<4, MT, kPrefetch>(w + row * kK512, x, kK512);
  });
}

// The same, the rows split between two threads (the kernels' split on this project's 2-core machines).
template <int MT>
double tile512_two_threads_ms(const float* w, const float* x, long rows) {
  const long half = rows / 8 * 4;
  return 1e3 * best_of_3([&] {
    std::thread other([&] {
      float own[4 * MT] = {};  // this thread's sums (sink is the main thread's)
      for (long row = half; row + 4 <= rows; row += 4) tile512<4, MT, true>(w + row * kK512, x, kK512, own);
      if (own[0] == 12345.0f) std::printf("(%g)\n", static_cast<double>(own[0]));  // keeps the sums live
    });
    for (long row = 0; row < half; row += 4) tile512<4, MT, true>(w + row * kK512, x, kK512);
    other.join();
  });
}

void avx512_report(const float* x) {
  // 106M weights: the default model's 30 decoder layers, one decode step's products on one core
  const long rows = 184320;
  const long hot_rows = 384;  // 884 KiB: L2, passed over 480 times for the same 106M weights
  float* hot = filled(hot_rows * kK512, 0.001f);
  float* cold = filled(rows * kK512, 0.001f);
  std::printf("-- avx512 tile (4 weight rows x MT x rows of 16 lanes), 106M fp32 weights, one core --\n");
  const double l2_1 = tile512_ms<1, false>(hot, x, hot_rows, rows / hot_rows);
  const double l2_5 = tile512_ms<5, false>(hot, x, hot_rows, rows / hot_rows);
  const double s1 = tile512_ms<1, true>(cold, x, rows, 1);
  const double s5 = tile512_ms<5, true>(cold, x, rows, 1);
  const double s5_bare = tile512_ms<5, false>(cold, x, rows, 1);
  const double fmas = static_cast<double>(rows) * kK512 / 16 * 5;
  std::printf("in L2:    1 x row %6.1f ms   5 x rows %6.1f ms (%.2f G FMA/s)\n", l2_1, l2_5, fmas / l2_5 / 1e6);
  std::printf("streamed: 1 x row %6.1f ms (%.1f GB/s)   5 x rows %6.1f ms = %.3f x 1 row   (no prefetch: %.1f ms)\n",
              s1, rows * kK512 * 4 / s1 / 1e6, s5, s5 / s1, s5_bare);
  std::printf("5 rows' extra over 1 row streamed: %.1f ms = %.2f of the arithmetic's extra in L2 (0: hidden, 1: added)\n",
              s5 - s1, (s5 - s1) / (l2_5 - l2_1));
  const double t1 = tile512_two_threads_ms<1>(cold, x, rows);
  const double t5 = tile512_two_threads_ms<5>(cold, x, rows);
  std::printf("streamed by two threads: 1 x row %6.1f ms (%.1f GB/s)   5 x rows %6.1f ms = %.3f x 1 row; extra %.2f of "
              "one core's arithmetic extra in L2, halved\n",
              t1, rows * kK512 * 4 / t1 / 1e6, t5, t5 / t1, (t5 - t1) / ((l2_5 - l2_1) / 2));
  std::free(hot);
  std::free(cold);
}
#endif

}  // namespace

int main() {
  const double peak = peak_fmas_per_s();
  std::printf("FMA peak (12 chains in registers)            %5.2f G FMA/s (%.0f GFLOP/s)\n", peak / 1e9, peak * 16 / 1e9);
  float* x = filled(16 * kK, 0.5f);
  float* hot = filled(256 * kK, 0.001f);  // 896 KiB: L2
  std::printf("-- register tiles, weights in L2 --\n");
  report<2, 6, false>("2 weight rows x 6 x rows", hot, x, 256, 200, false);
  report<1, 8, false>("1 weight row x 8 x rows", hot, x, 256, 200, false);
  report<2, 4, false>("2 weight rows x 4 x rows", hot, x, 256, 200, false);
  report<2, 2, false>("2 weight rows x 2 x rows", hot, x, 256, 200, false);
  const long rows = 9728 * 24;  // 836 MiB of fp32 weights: far past the caches
  float* cold = filled(rows * kK, 0.001f);
  std::printf("-- streamed from memory (x rows = activation rows of one product) --\n");
  report<2, 1, true>("1 x row, prefetch", cold, x, rows, 1, true);
  report<2, 6, true>("6 x rows, prefetch", cold, x, rows, 1, true);
  report<2, 6, false>("6 x rows, no prefetch", cold, x, rows, 1, true);
  report<1, 8, true>("8 x rows (1 weight row x 8), prefetch", cold, x, rows, 1, true);
#if defined(__AVX512F__)
  avx512_report(x);
#endif
  std::printf("(%g)\n", static_cast<double>(sink[0]));
  return 0;
}
