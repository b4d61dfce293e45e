// What one core of this machine can do for a few-row fp32 product, apart from the kernels'
// surroundings (threads, Python, torch): the AVX2 FMA peak, the kernels' register-tile loop
// (kernels/blocks.h: `block`) with its operands in L1 or L2, and the same loop streaming a
// weight matrix larger than the caches with and without the kernels' L2 prefetch
// (simd::prefetch_ahead, 32 KiB ahead). One thread; best of 3 runs per figure.
//
// Build and run (AVX2 + FMA, as the kernels' avx2 variant):
//   g++ -O3 -mavx2 -mfma -ffp-contract=off benchmark/fma_ceiling.cpp -o /tmp/fma_ceiling && /tmp/fma_ceiling
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>

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
  std::printf("(%g)\n", static_cast<double>(sink[0]));
  return 0;
}
