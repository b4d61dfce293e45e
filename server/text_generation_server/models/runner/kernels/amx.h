// bf16 few-row products on AMX tiles (the amx_bf16 variant): y[m, n] = x[m, k] @ W[n, k]^T.
//
// Design note: TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums
// in one instruction. The weights are the A tiles as they lie in memory (16 rows of 64 bytes,
// a row's stride apart), so nothing is repacked at load; the x rows are the B tile, packed once
// per call in pairs of k (what the instruction pairs), m x rows as its columns. One tile
// product of 1 KB of weights serves every x row at once, so 1..16 x rows cost the weight stream
// alone: on a Sapphire-Rapids-class core, 70 MB of weights at 1 / 4 / 8 / 16 x rows took
// 2.5 / 2.5 / 2.6 / 2.9 ms, where the AVX-512 blocks (blocks.h) take 1.85x a row's time at 8.
// Four sums run at once (chunks of k in turns): one product's latency is several times its issue
// interval. The sums for weight row r and x row j run over k in chunk order whatever m is, so a
// row's product does not depend on the other rows (the exactness of verification, blocks.h);
// they differ from the AVX-512 variants' in the last bits (the tile unit's own order of fp32
// additions, which no simple sequence of fp32 adds reproduces), so a process uses one variant
// for every row count. k and n that are not whole tiles go through a zero-padded copy of the
// partial tile. The OS must grant the process AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
// Linux >= 5.16): `permitted()` asks once; refused, products take the AVX-512 blocks instead
// (cpu_kernels.py does not choose this variant then).
#pragma once

#if defined(__AMX_BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace tgi::amx {

constexpr int64_t kTile = 16;   // weight rows of a block (an A tile), pairs of k of a B tile, x rows at most
constexpr int64_t kChunk = 32;  // k values of a tile row (64 bytes)
constexpr int64_t kSums = 4;    // chunk i of k adds to sums i % 4: four independent chains

inline bool permitted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // <asm/prctl.h>, the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Tiles 0-3: the four sums of a block (16 weight rows x m x rows, fp32); 4 and 5: x chunks (16
// pairs of k x m rows); 6 and 7: weight chunks (16 rows x 32 values). Loads alternate between
// two tiles so that a load does not wait for the product still reading the other.
inline void configure(int64_t m) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.colsb[t] = t < 6 ? static_cast<uint16_t>(m * 4) : 64;
  }
  // GCC does not see LDTILECFG read the struct and may drop the stores to it (seen at -O2 in a
  // test program: tiles left unconfigured, SIGILL): the barrier keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// x [m, k] as B tiles: pair p of x row j at (p * m + j) * 2, k zero-padded to whole chunks.
struct PackedX {
  simd::Buffer<uint32_t> pairs;
  int64_t m;
  PackedX(const uint16_t* x, int64_t m_, int64_t k) : pairs(m_ * ((k + kChunk - 1) / kChunk * kChunk / 2), 0), m(m_) {
    if (m == 1) {
      std::memcpy(pairs.data(), x, k * 2);
    } else if (k % 2 == 0) {  // pair p of every row in one gather
      const __m512i starts = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(static_cast<int>(k / 2)));
      const __mmask16 rows = static_cast<__mmask16>((1u << m) - 1);
      const auto* x32 = reinterpret_cast<const int*>(x);
      for (int64_t p = 0; p < k / 2; ++p)
        _mm512_mask_storeu_epi32(&pairs[p * m], rows,
                                 _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, starts, x32 + p, 4));
    } else {
      for (int64_t j = 0; j < m; ++j) {
        const uint16_t* row = x + j * k;
        for (int64_t p = 0; p < k / 2; ++p) std::memcpy(&pairs[p * m + j], row + 2 * p, 4);
        pairs[k / 2 * m + j] = row[k - 1];  // the last value, paired with a zero
      }
    }
  }
  const uint32_t* chunk(int64_t c) const { return pairs.data() + c / 2 * m; }
  int64_t stride() const { return m * 4; }
};

// Weight rows row + i * spread for i < rows (rows <= 16), k values [c, c + 32) of them, zero-padded, as a tile.
inline const uint16_t* staged(const uint16_t* w, int64_t k, int64_t row, int64_t spread, int64_t rows, int64_t c,
                              uint16_t (&tile)[kTile][kChunk]) {
  std::memset(tile, 0, sizeof(tile));
  const int64_t count = std::min(kChunk, k - c);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(tile[i], w + (row + i * spread) * k + c, count * 2);
  return &tile[0][0];
}

// Chunk i of k (weights at `weights`, `stride` bytes between rows) into sums i % 4. The tile
// intrinsics take tile numbers as literals: one branch per sum.
template <int i>
inline void multiply(const PackedX& x, int64_t c, const void* weights, int64_t stride) {
  if constexpr (i == 0) {
    _tile_loadd(4, x.chunk(c), x.stride());
    _tile_loadd(6, weights, stride);
    _tile_dpbf16ps(0, 6, 4);
  } else if constexpr (i == 1) {
    _tile_loadd(5, x.chunk(c), x.stride());
    _tile_loadd(7, weights, stride);
    _tile_dpbf16ps(1, 7, 5);
  } else if constexpr (i == 2) {
    _tile_loadd(4, x.chunk(c), x.stride());
    _tile_loadd(6, weights, stride);
    _tile_dpbf16ps(2, 6, 4);
  } else {
    _tile_loadd(5, x.chunk(c), x.stride());
    _tile_loadd(7, weights, stride);
    _tile_dpbf16ps(3, 7, 5);
  }
}
inline void multiply_any(int64_t i, const PackedX& x, int64_t c, const void* weights, int64_t stride) {
  switch (i % kSums) {
    case 0: multiply<0>(x, c, weights, stride); break;
    case 1: multiply<1>(x, c, weights, stride); break;
    case 2: multiply<2>(x, c, weights, stride); break;
    default: multiply<3>(x, c, weights, stride); break;
  }
}

// Weight rows row + i * spread for i < rows (rows <= 16) against every x row: sums[s][i][j], s < kSums.
inline void block(const uint16_t* w, int64_t k, int64_t row, int64_t spread, int64_t rows, const PackedX& x,
                  float (&sums)[kSums][kTile][kTile]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = spread * k * 2;
  const uint16_t* weights = w + row * k;
  const int64_t steps = rows == kTile ? k / (kSums * kChunk) * (kSums * kChunk) : 0;
  for (int64_t c = 0; c < steps; c += kSums * kChunk) {
    multiply<0>(x, c, weights + c, stride);
    multiply<1>(x, c + kChunk, weights + c + kChunk, stride);
    multiply<2>(x, c + 2 * kChunk, weights + c + 2 * kChunk, stride);
    multiply<3>(x, c + 3 * kChunk, weights + c + 3 * kChunk, stride);
  }
  for (int64_t c = steps; c < k; c += kChunk) {  // the rest: whole chunks of whole rows, else a padded copy
    alignas(64) uint16_t tile[kTile][kChunk];
    const bool whole = rows == kTile && c + kChunk <= k;
    multiply_any(c / kChunk, x, c, whole ? weights + c : staged(w, k, row, spread, rows, c, tile), whole ? stride : 64);
  }
  _tile_stored(0, &sums[0][0][0], 64);
  _tile_stored(1, &sums[1][0][0], 64);
  _tile_stored(2, &sums[2][0][0], 64);
  _tile_stored(3, &sums[3][0][0], 64);
}

// The whole product on the tiles. A block's 16 weight rows lie n / 16 rows apart (rounded up:
// `spread`), and block b holds rows b, b + spread, ..: each of a tile's 16 rows then continues
// where the previous block's left off, so a thread's blocks read 16 long sequential streams, which
// the hardware prefetchers follow. Blocks of 16 neighbouring rows read the 0.5B's rows of 896
// values (1.8 KB) in 16 short streams per 28 KB: 26.6 GB/s against 31.2 spread this way (2 threads,
// a plain read 30.3; software prefetching measured slower on this path). The sums of 16
// consecutive blocks are kept, so that each x row's outputs are written 16 neighbours at a time.
// Output y[j, row] = ((s0 + s1) + s2) + s3 (+ bias) for the sums s of that weight row and x row j.
inline void run(const uint16_t* x_rows, const uint16_t* w, int64_t m, int64_t k, int64_t n, const float* bias,
                uint16_t* y) {
  const PackedX x(x_rows, m, k);
  const int64_t spread = (n + kTile - 1) / kTile;  // blocks, and the rows between a block's rows
  const int64_t grain = std::max<int64_t>(1, 65536 / (kTile * k * 2));  // ~64 KiB of weights per task
  // lane q: element [q][0][0] of a [16][16][16] array
  const __m512i blocks_apart = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(kTile * kTile));
  at::parallel_for(0, spread, grain, [&](int64_t b0, int64_t b1) {
    configure(m);
    alignas(64) float sums[kSums][kTile][kTile];
    alignas(64) float kept[kTile][kTile][kTile];  // [block q of 16][weight row i of the block][x row j]
    for (int64_t first = b0; first < b1; first += kTile) {
      const int64_t count = std::min(kTile, b1 - first);
      for (int64_t q = 0; q < count; ++q) {
        const int64_t row = first + q;
        block(w, k, row, spread, std::min(kTile, (n - row + spread - 1) / spread), x, sums);
        for (int64_t i = 0; i < kTile; ++i) {  // the four sums, in a fixed order
          _mm512_store_ps(kept[q][i], _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_load_ps(sums[0][i]),
                                                                               _mm512_load_ps(sums[1][i])),
                                                                 _mm512_load_ps(sums[2][i])),
                                                   _mm512_load_ps(sums[3][i])));
        }
      }
      // Weight rows first + q + i * spread for q < count are neighbours in y: one store per x row.
      for (int64_t i = 0; i < kTile && first + i * spread < n; ++i) {
        const int64_t start = first + i * spread;
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min(count, n - start)) - 1);
        const __m512 bias_rows = bias ? _mm512_maskz_loadu_ps(mask, bias + start) : _mm512_setzero_ps();
        for (int64_t j = 0; j < m; ++j) {
          const __m512 value = _mm512_add_ps(_mm512_i32gather_ps(blocks_apart, &kept[0][i][j], 4), bias_rows);
          const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(simd::round_to_bf16(value)), 16);
          _mm256_mask_storeu_epi16(y + j * n + start, mask, _mm512_cvtepi32_epi16(bits));
        }
      }
    }
    _tile_release();
  });
}

}  // namespace tgi::amx

#endif  // __AMX_BF16__
