// The few-row product y[m, n] = x[m, k] @ W[n, k]^T, written once over a weight format.
//
// Design note: at decode and verification time m (rows x new tokens) is 1..16 while W is read
// whole from memory, so the cost is the weight stream. Generic GEMMs tile for large m: on the
// machines of this project they run a bf16 matrix-vector product at half the memory bandwidth
// and an 8-row fp32 product 2.5x slower than a 1-row one. Here each block of kRows weight rows is
// loaded once per chunk of k, decoded to fp32 in registers (a format: fp32, bf16 widened by a
// shift, 4-bit codes through a 16-entry table), and multiplied with every x row of a register
// tile while it sits in registers and L1, so m rows cost about what one row costs until the
// FMA units, not memory, are the limit. The activations are prepared once per call in the
// order the format decodes weights (padded with zeros to whole chunks), so a format's decode
// order never shows in the result. Output rows are split across torch's own OpenMP team
// (at::parallel_for): no second thread pool competes for the cores.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace tgi::blocks {

using simd::F;
constexpr int kRows = 4;  // weight rows per block
#if defined(__AVX512F__)
constexpr int kTileLimit = 6;  // x rows per register tile (32 vector registers: 4 x 6 sums + 4 weights + x)
#else
constexpr int kTileLimit = 2;  // 16 vector registers: 4 x 2 sums + 4 weight vectors + 1 x vector
#endif

constexpr int kPrefetchGroup = 4;  // chunks per turn when the x-row tiles of a block share its prefetches

inline int64_t round_up(int64_t value, int64_t step) { return (value + step - 1) / step * step; }

// The x rows of one call, in a format's order and element type: [m, padded_k].
template <typename X>
struct Prepared {
  simd::Buffer<X> values;
  int64_t padded_k = 0;
  Prepared(int64_t m, int64_t k, int64_t chunk) : values(m * round_up(k, chunk), X{}), padded_k(round_up(k, chunk)) {}
  X* row(int64_t j) { return values.data() + j * padded_k; }
  const X* row(int64_t j) const { return values.data() + j * padded_k; }
};

// fp32 weights, used as they are (also the decoded blocks of quantized weights).
struct F32Weights {
  using X = float;
  static constexpr int64_t kChunk = simd::kLanes;
  static constexpr int kMaxTile = 6;  // AVX-512: a 5- or 6-token verification in one tile (AVX2: kTileLimit, 2)
  static constexpr int kTallTile = 6;  // AVX2, pairs of weight rows: 12 sums + 2 weights + x
#if defined(__AVX512F__)
  static constexpr int kWideTile = 12, kWideMax = 12;  // wide_rows for 7..12 x rows
#else
  static constexpr int kWideTile = 0;  // see wide_rows: pairs lost on the Zen 4 (x rows in fp32 fill L1)
#endif
  struct Vals { F v; };
  const float* w;
  int64_t k;

  const float* at(int64_t row, int64_t c) const { return w + row * k + c; }
  Vals load(int64_t row, int64_t c) const { return {simd::load(at(row, c))}; }
  Vals load_tail(int64_t row, int64_t c, int64_t k_end) const {
    alignas(64) float part[kChunk] = {};
    std::memcpy(part, at(row, c), (k_end - c) * sizeof(float));
    return {simd::load(part)};
  }
  void prefetch(int64_t row, int64_t c) const { simd::prefetch_ahead(at(row, c)); }
  int64_t row_bytes(int64_t k_) const { return k_ * 4; }
  static F madd(F acc, const Vals& v, const float* x) { return simd::fmadd(v.v, simd::load(x), acc); }

  static Prepared<float> prepare(const float* x, int64_t m, int64_t k_) {
    Prepared<float> out(m, k_, kChunk);
    for (int64_t j = 0; j < m; ++j) std::memcpy(out.row(j), x + j * k_, k_ * sizeof(float));
    return out;
  }
};

// bf16 weights (in the avx512_bf16 variant also the decoded blocks of 4-bit weights whose compute
// dtype is bf16, quantized.cpp).
#if defined(__AVX512BF16__)
// vdpbf16ps on 256-bit vectors (AVX-512 VL): pairs of bf16 products summed into fp32 lanes; x
// stays bf16. The 512-bit form streamed one-row products slower on a Zen 4 (a 212 MB product at
// 41 GB/s against the 256-bit AVX2 loops' 50-56); the FMA rate of both forms is the same there.
struct Bf16Weights {
  using X = uint16_t;
  using V = __m256;
  static constexpr int64_t kChunk = 16;
  static constexpr int kMaxTile = 4;
  static constexpr int kTallTile = 4;  // unused (AVX-512)
  static constexpr int kWideTile = 12, kWideMax = 16;  // wide_rows: 24 sums + 2 weights + x of 32 vector registers
  struct Vals { __m256i v; };
  const uint16_t* w;
  int64_t k;

  Vals load(int64_t row, int64_t c) const {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + row * k + c))};
  }
  Vals load_tail(int64_t row, int64_t c, int64_t k_end) const {
    alignas(32) uint16_t part[kChunk] = {};
    std::memcpy(part, w + row * k + c, (k_end - c) * sizeof(uint16_t));
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(part))};
  }
  void prefetch(int64_t row, int64_t c) const { simd::prefetch_ahead(w + row * k + c); }
  int64_t row_bytes(int64_t k_) const { return k_ * 2; }
  static V madd(V acc, const Vals& v, const uint16_t* x) {
    return _mm256_dpbf16_ps(acc, (__m256bh)v.v, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }

  static Prepared<uint16_t> prepare(const uint16_t* x, int64_t m, int64_t k_) {
    Prepared<uint16_t> out(m, k_, kChunk);
    for (int64_t j = 0; j < m; ++j) std::memcpy(out.row(j), x + j * k_, k_ * sizeof(uint16_t));
    return out;
  }
};
#else
// Widened to fp32 by a shift (exact), then FMA; x is widened once per call in the same order.
struct Bf16Weights {
  using X = float;
  static constexpr int64_t kChunk = 2 * simd::kLanes;
  static constexpr int kMaxTile = 5;  // AVX-512: 4 x 5 sums + 8 weight vectors + x (AVX2: kTileLimit, 2)
  static constexpr int kTallTile = 5;  // AVX2, pairs of weight rows: 10 sums + 4 weights + x
#if defined(__AVX512F__)
  static constexpr int kWideTile = 12, kWideMax = 12;  // 6..12 x rows (10-12: 0.93-0.95x 4 x 5 tiles' time)
#else
  static constexpr int kWideTile = 0;  // x rows in fp32, as F32Weights
#endif
  struct Vals { F lo, hi; };
  const uint16_t* w;
  int64_t k;

  Vals load(int64_t row, int64_t c) const {
    Vals v;
    simd::widen_bf16(w + row * k + c, v.lo, v.hi);
    return v;
  }
  Vals load_tail(int64_t row, int64_t c, int64_t k_end) const {
    alignas(64) uint16_t part[kChunk] = {};
    std::memcpy(part, w + row * k + c, (k_end - c) * sizeof(uint16_t));
    Vals v;
    simd::widen_bf16(part, v.lo, v.hi);
    return v;
  }
  void prefetch(int64_t row, int64_t c) const { simd::prefetch_ahead(w + row * k + c); }
  int64_t row_bytes(int64_t k_) const { return k_ * 2; }
  static F madd(F acc, const Vals& v, const float* x) {
    return simd::fmadd(v.hi, simd::load(x + simd::kLanes), simd::fmadd(v.lo, simd::load(x), acc));
  }

  static Prepared<float> prepare(const uint16_t* x, int64_t m, int64_t k_) {
    Prepared<float> out(m, k_, kChunk);
    simd::Buffer<uint16_t> padded(out.padded_k, 0);
    for (int64_t j = 0; j < m; ++j) {
      std::memcpy(padded.data(), x + j * k_, k_ * sizeof(uint16_t));
      for (int64_t c = 0; c < out.padded_k; c += kChunk) {
        F lo, hi;
        simd::widen_bf16(padded.data() + c, lo, hi);
        simd::store(out.row(j) + c, lo);
        simd::store(out.row(j) + c + simd::kLanes, hi);
      }
    }
    return out;
  }
};
#endif

// The vector type of a format's sums: W::V where it names one (256-bit sums in an AVX-512 build),
// else the build's own.
template <class W, class = void>
struct SumsOf { using type = F; };
template <class W>
struct SumsOf<W, std::void_t<typename W::V>> { using type = typename W::V; };

// Writes rows r of acc (+ bias) to y[m0 + j, row + r] for the R rows and MT x rows of a block.
template <int R, int MT, typename V, typename Out>
inline void store(V (&acc)[R][MT], Out* y, int64_t n, int64_t m0, int64_t row, const float* bias) {
  for (int j = 0; j < MT; ++j) {
    float sums[4];
    if constexpr (R == 4 || R == 2) {  // a pair sums as a block's first two rows do (results do not depend on m)
      V column[4] = {acc[0][j], acc[1][j], acc[R - 2][j], acc[R - 1][j]};
      simd::hsum4(column, sums);
    } else {
      for (int r = 0; r < R; ++r) sums[r] = simd::hsum(acc[r][j]);
    }
    for (int r = 0; r < R; ++r) {
      const float value = sums[r] + (bias ? bias[row + r] : 0.0f);
      if constexpr (sizeof(Out) == 2) {
        y[(m0 + j) * n + row + r] = simd::to_bf16(value);
      } else {
        y[(m0 + j) * n + row + r] = value;
      }
    }
  }
}

// y[m0 .. m0 + MT, row .. row + R] for one block; the k tail (if any) is a zero-padded chunk.
// kShared: tile `tile` of the `tiles` (> 1) x-row tiles that multiply these weight rows.
template <class W, int R, int MT, bool kShared, typename Out>
inline void block(const W& w, const Prepared<typename W::X>& x, int64_t k, int64_t m0, Out* y, int64_t n, int64_t row,
                  const float* bias, int tile, int tiles) {
  using V = typename SumsOf<W>::type;
  V acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = V{};
  auto multiply = [&](const typename W::Vals (&v)[R], int64_t c) {
    for (int j = 0; j < MT; ++j) {
      const typename W::X* xj = x.row(m0 + j) + c;
      for (int r = 0; r < R; ++r) acc[r][j] = W::madd(acc[r][j], v[r], xj);
    }
  };
  // The first tile streams the block from memory, later tiles find it in L1. Each chunk read asks
  // L2 for what lies simd::kAheadBytes ahead (past the last row this names memory outside W:
  // prefetches are hints and never fault). With several tiles those requests are dealt to all of
  // them in turns of kPrefetchGroup chunks, so memory is read while every tile computes: asked by
  // the first tile alone, nothing was read while the others ran (products of 8-16 x rows of the
  // 0.5B's shapes took 3-5% longer in fp32 on avx2, 9-13% in bf16 on avx512_bf16).
  [[maybe_unused]] int turn = 0, in_group = 0;  // kShared: whose turn it is to ask, how far into it
  const int64_t whole = k / W::kChunk * W::kChunk;
  for (int64_t c = 0; c < whole; c += W::kChunk) {
    typename W::Vals v[R];
    for (int r = 0; r < R; ++r) v[r] = w.load(row + r, c);
#ifndef TGI_NO_PREFETCH
    if (!kShared || turn == tile)
      for (int r = 0; r < R; ++r) w.prefetch(row + r, c);
    if constexpr (kShared) {
      if (++in_group == kPrefetchGroup) {
        in_group = 0;
        if (++turn == tiles) turn = 0;
      }
    }
#endif
    multiply(v, c);
  }
  if (whole < k) {
    typename W::Vals v[R];
    for (int r = 0; r < R; ++r) v[r] = w.load_tail(row + r, whole, k);
    multiply(v, whole);
  }
  store<R, MT>(acc, y, n, m0, row, bias);
}

template <int T, class Fn>
inline void last_tile(int64_t rest, int64_t m0, Fn& fn) {
  if constexpr (T > 0) {
    if (rest == T) {
      fn(std::integral_constant<int, T>{}, m0);
    } else {
      last_tile<T - 1>(rest, m0, fn);
    }
  }
}

// fn(std::integral_constant<int, size>{}, m0) for x rows 0 .. m in tiles of T, the last one shorter:
// every tile size is a compile-time constant, so each size gets its own unrolled code.
template <int T, class Fn>
inline void for_tiles(int64_t m, Fn&& fn) {
  int64_t m0 = 0;
  for (; m0 + T <= m; m0 += T) fn(std::integral_constant<int, T>{}, m0);
  last_tile<T - 1>(m - m0, m0, fn);
}

// More x rows than one tile of T: the tiles take turns at the block's prefetches (block,
// kShared). Out of line, so that the one-tile path (every decode step at batch 1) stays inlined
// in run as it was: with both inlined there, GCC called rows_against_all_x per block and one-row
// products ran 2-3% slower.
template <class W, int R, int T, typename Out>
[[gnu::noinline]] void shared_tiles(const W& w, const Prepared<typename W::X>& x, int64_t m, int64_t k, Out* y,
                                    int64_t n, int64_t row, const float* bias) {
  const int count = static_cast<int>((m + T - 1) / T);
  for_tiles<T>(m, [&](auto size, int64_t m0) {
    block<W, R, decltype(size)::value, true>(w, x, k, m0, y, n, row, bias, static_cast<int>(m0 / T), count);
  });
}

// x rows in tiles of T against weight rows row .. row + R.
template <class W, int R, int T, typename Out>
inline void tiles(const W& w, const Prepared<typename W::X>& x, int64_t m, int64_t k, Out* y, int64_t n, int64_t row,
                  const float* bias) {
  if (m > T) {
    shared_tiles<W, R, T>(w, x, m, k, y, n, row, bias);
    return;
  }
  for_tiles<T>(m, [&](auto size, int64_t m0) {
    block<W, R, decltype(size)::value, false>(w, x, k, m0, y, n, row, bias, 0, 1);
  });
}

// x rows per tile of kRows weight rows: what the registers hold, or less where a format says so.
template <class W>
constexpr int tile_of = std::min(kTileLimit, W::kMaxTile);

// Weight rows row .. row + R against every x row. With 16 vector registers (AVX2) a block of 4
// weight rows leaves room for 2 x rows per tile; from 3 x rows on, pairs of weight rows in
// tiles of W::kTallTile x rows load each weight chunk fewer times (3..6 rows: once).
template <class W, int R, typename Out>
inline void rows_against_all_x(const W& w, const Prepared<typename W::X>& x, int64_t m, int64_t k, Out* y, int64_t n,
                               int64_t row, const float* bias) {
#if !defined(__AVX512F__)
  if constexpr (R == kRows) {
    if (m >= 3) {
      for (int r = 0; r < R; r += 2) tiles<W, 2, W::kTallTile>(w, x, m, k, y, n, row + r, bias);
      return;
    }
  }
#endif
  tiles<W, R, tile_of<W>>(w, x, m, k, y, n, row, bias);
}

// Weight rows row .. row + kRows against more x rows than one tile (tile_of), up to W::kWideMax,
// for a format with W::kWideTile > 0 (bf16 weights on the avx512_bf16 variant, fp32 and widened
// bf16 weights on the other AVX-512 variants): pairs of weight rows against up to kWideTile x rows
// at once (13-16 x rows: two tiles of up to 8), so every weight chunk read from memory is used for
// every x row while it is in registers, and the weight stream overlaps the arithmetic throughout.
// In 4 x 4 tiles the first tile waits on memory and the others on the FMA units, one after the
// other: on the 0.5B's shapes (bf16, 2 threads, a Zen 4) 8 x rows took 1.60x one row's time that
// way and 1.24x in pairs, 16 rows 2.95x and 2.49x. fp32 x rows are twice the bytes, so the pairs' x
// stream leaves L1: on the Zen 4 pairs lost (8 rows 81 -> 93 ms; its fp32 runs the avx2 variant);
// on AVX-512 (4 x 6 tiles; an AMX Xeon) they win at 7..12 rows (0.94-0.97x the time) and lose at 16
// (1.17x in two tiles of 8), so fp32 stops at 12 (kWideMax) and 13..16 rows take 4 x 6 tiles again.
template <class W, typename Out>
inline void wide_rows(const W& w, const Prepared<typename W::X>& x, int64_t m, int64_t k, Out* y, int64_t n,
                      int64_t row, const float* bias) {
  static_assert(kRows % 2 == 0 && W::kWideTile >= 8, "pairs of weight rows, 13-16 x rows in two tiles of 8");
  for (int r = 0; r < kRows; r += 2) {
    if constexpr (W::kWideMax > W::kWideTile) {  // only formats that go past one wide tile build the eights
      if (m > W::kWideTile) {
        tiles<W, 2, 8>(w, x, m, k, y, n, row + r, bias);
        continue;
      }
    }
    tiles<W, 2, W::kWideTile>(w, x, m, k, y, n, row + r, bias);
  }
}

// The whole product: blocks of kRows weight rows (then single rows) split across the threads.
template <class W, typename Out>
void run(const W& w, const Prepared<typename W::X>& x, int64_t m, int64_t k, int64_t n, const float* bias, Out* y) {
  const int64_t blocks = (n + kRows - 1) / kRows;
  // ~64 KiB of weights per task: small matrices still split across both cores.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kRows * w.row_bytes(k)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t end = std::min(n, b1 * kRows);
    int64_t row = b0 * kRows;
    for (; row + kRows <= end; row += kRows) {
      if constexpr (W::kWideTile > 0) {
        if (m > tile_of<W> && m <= W::kWideMax) {
          wide_rows(w, x, m, k, y, n, row, bias);
          continue;
        }
      }
      rows_against_all_x<W, kRows>(w, x, m, k, y, n, row, bias);
    }
    for (; row < end; ++row) rows_against_all_x<W, 1>(w, x, m, k, y, n, row, bias);
  });
}

}  // namespace tgi::blocks
