// Few-row products on AMX tiles (the amx variant): y[m, n] = x[m, k] @ W[n, k]^T, for bf16 weights
// (TDPBF16PS, fp32 sums) and LLM.int8()'s int8 codes (TDPBSSD, exact int32 sums).
//
// Design note: one tile product multiplies 16 weight rows of 64 bytes (32 bf16 or 64 int8 values)
// by the matching 64 bytes of up to 16 x rows into 16 x m sums. The weights are the A tiles as they
// lie in memory (16 rows of 64 bytes, a row's stride apart), so nothing is repacked at load; the x
// rows are the B tile, packed once per call in groups of 4 bytes along k (a pair of bf16 or a quad
// of int8 values: what the instructions pair), m x rows as its columns. One tile product of 1 KB
// of weights serves every x row at once, so 1..16 x rows cost the weight stream alone: on a
// Sapphire-Rapids-class core, 70 MB of bf16 weights at 1 / 4 / 8 / 16 x rows took 2.5 / 2.5 / 2.6 /
// 2.9 ms, where the AVX-512 blocks (blocks.h) take 1.85x a row's time at 8. Four sums run at once
// (chunks of k in turns): one product's latency is several times its issue interval.
// bf16: the sums for weight row r and x row j run over k in chunk order whatever m is, so a row's
// product does not depend on the other rows (the exactness of verification, blocks.h); they differ
// from the AVX-512 variants' in the last bits (the tile unit's own order of fp32 additions, which no
// simple sequence of fp32 adds reproduces), so a process uses one variant for every row count.
// int8: integer sums are exact in any order, so the tiles give the very sums of the AVX-512 VNNI
// dot products (quantized.cpp). k and n that are not whole tiles go through a zero-padded copy of
// the partial tile. The OS must grant the process AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
// Linux >= 5.16): `permitted()` asks once; refused, products take the AVX-512 code instead
// (cpu_kernels.py does not choose this variant then).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define TGI_AMX 1

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace tgi::amx {

constexpr int64_t kTile = 16;       // weight rows of a block (an A tile), 4-byte groups of a B tile, x rows at most
constexpr int64_t kTileBytes = 64;  // bytes of a tile row: 32 bf16 or 64 int8 values of k
constexpr int64_t kSums = 4;        // chunk i of k adds to sums i % 4: four independent chains

enum class Dot { kBf16, kInt8 };  // TDPBF16PS (fp32 sums) or TDPBSSD (signed int8, int32 sums)

inline bool permitted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // <asm/prctl.h>, the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Tiles 0-7 as rows[t] rows of bytes[t] bytes each.
inline void load_config(const int64_t (&rows)[8], const int64_t (&bytes)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows[t]);
    config.colsb[t] = static_cast<uint16_t>(bytes[t]);
  }
  // GCC does not see LDTILECFG read the struct and may drop the stores to it (seen at -O2 in a
  // test program: tiles left unconfigured, SIGILL): the barrier keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Tiles 0-3: the four sums of a block (16 weight rows x m x rows, 4 bytes each); 4 and 5: x
// chunks (16 groups of 4 bytes x m rows); 6 and 7: weight chunks (16 rows x 64 bytes). Loads
// alternate between two tiles so that a load does not wait for the product still reading the other.
inline void configure(int64_t m) {
  load_config({kTile, kTile, kTile, kTile, kTile, kTile, kTile, kTile},
              {m * 4, m * 4, m * 4, m * 4, m * 4, m * 4, kTileBytes, kTileBytes});
}

// x rows of `bytes` bytes each (`row_bytes` apart) as B tiles of m columns: 4-byte group p of x row
// j at word p * m + j, every row zero-padded to whole tile rows; columns from `valid` on are zeros.
struct PackedX {
  simd::Buffer<uint32_t> words;
  int64_t m;
  PackedX(const void* x, int64_t m_, int64_t valid, int64_t row_bytes, int64_t bytes)
      : words(m_ * ((bytes + kTileBytes - 1) / kTileBytes * kTileBytes / 4), 0), m(m_) {
    const auto* base = static_cast<const uint8_t*>(x);
    if (m == 1) {
      std::memcpy(words.data(), base, bytes);
      return;
    }
    int64_t p = 0;
    if (row_bytes % 4 == 0) {  // group p of every row in one gather
      const __m512i starts = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(static_cast<int>(row_bytes / 4)));
      const __mmask16 rows = static_cast<__mmask16>((1u << m) - 1), read = static_cast<__mmask16>((1u << valid) - 1);
      const auto* x32 = reinterpret_cast<const int*>(base);
      for (; p < bytes / 4; ++p)
        _mm512_mask_storeu_epi32(&words[p * m], rows,
                                 _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), read, starts, x32 + p, 4));
    }
    for (; 4 * p < bytes; ++p)  // the rest (odd rows of bf16: the last value paired with a zero)
      for (int64_t j = 0; j < valid; ++j)
        std::memcpy(&words[p * m + j], base + j * row_bytes + 4 * p, std::min<int64_t>(4, bytes - 4 * p));
  }
  const uint32_t* chunk(int64_t c) const { return words.data() + c / 4 * m; }  // c: a byte offset, whole tile rows
  int64_t stride() const { return m * 4; }
};

// Bytes [c, c + 64) of weight rows row + i * spread for i < rows (rows <= 16), zero-padded, as a tile.
inline const uint8_t* staged(const uint8_t* w, int64_t row_bytes, int64_t row, int64_t spread, int64_t rows, int64_t c,
                             uint8_t (&tile)[kTile][kTileBytes]) {
  std::memset(tile, 0, sizeof(tile));
  const int64_t count = std::min(kTileBytes, row_bytes - c);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(tile[i], w + (row + i * spread) * row_bytes + c, count);
  return &tile[0][0];
}

// Chunk i of k (weights at `weights`, `stride` bytes between rows) into sums i % 4. The tile
// intrinsics take tile numbers as literals (GCC pastes them into the assembly): one branch per sum.
template <Dot kDot, int i>
inline void multiply(const PackedX& x, int64_t c, const void* weights, int64_t stride) {
  constexpr bool kBf16 = kDot == Dot::kBf16;
  if constexpr (i == 0) {
    _tile_loadd(4, x.chunk(c), x.stride());
    _tile_loadd(6, weights, stride);
    if constexpr (kBf16) _tile_dpbf16ps(0, 6, 4); else _tile_dpbssd(0, 6, 4);
  } else if constexpr (i == 1) {
    _tile_loadd(5, x.chunk(c), x.stride());
    _tile_loadd(7, weights, stride);
    if constexpr (kBf16) _tile_dpbf16ps(1, 7, 5); else _tile_dpbssd(1, 7, 5);
  } else if constexpr (i == 2) {
    _tile_loadd(4, x.chunk(c), x.stride());
    _tile_loadd(6, weights, stride);
    if constexpr (kBf16) _tile_dpbf16ps(2, 6, 4); else _tile_dpbssd(2, 6, 4);
  } else {
    _tile_loadd(5, x.chunk(c), x.stride());
    _tile_loadd(7, weights, stride);
    if constexpr (kBf16) _tile_dpbf16ps(3, 7, 5); else _tile_dpbssd(3, 7, 5);
  }
}
template <Dot kDot>
inline void multiply_any(int64_t i, const PackedX& x, int64_t c, const void* weights, int64_t stride) {
  switch (i % kSums) {
    case 0: multiply<kDot, 0>(x, c, weights, stride); break;
    case 1: multiply<kDot, 1>(x, c, weights, stride); break;
    case 2: multiply<kDot, 2>(x, c, weights, stride); break;
    default: multiply<kDot, 3>(x, c, weights, stride); break;
  }
}

// Weight rows row + i * spread for i < rows (rows <= 16; `row_bytes` each) against every x row:
// sums[s][i][j], s < kSums (float for bf16, int32_t for int8).
template <Dot kDot, typename Sum>
inline void block(const uint8_t* w, int64_t row_bytes, int64_t row, int64_t spread, int64_t rows, const PackedX& x,
                  Sum (&sums)[kSums][kTile][kTile]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = spread * row_bytes;
  const uint8_t* weights = w + row * row_bytes;
  const int64_t steps = rows == kTile ? row_bytes / (kSums * kTileBytes) * (kSums * kTileBytes) : 0;
  for (int64_t c = 0; c < steps; c += kSums * kTileBytes) {
    multiply<kDot, 0>(x, c, weights + c, stride);
    multiply<kDot, 1>(x, c + kTileBytes, weights + c + kTileBytes, stride);
    multiply<kDot, 2>(x, c + 2 * kTileBytes, weights + c + 2 * kTileBytes, stride);
    multiply<kDot, 3>(x, c + 3 * kTileBytes, weights + c + 3 * kTileBytes, stride);
  }
  for (int64_t c = steps; c < row_bytes; c += kTileBytes) {  // the rest: whole chunks of whole rows, else a padded copy
    alignas(64) uint8_t tile[kTile][kTileBytes];
    const bool whole = rows == kTile && c + kTileBytes <= row_bytes;
    multiply_any<kDot>(c / kTileBytes, x, c, whole ? weights + c : staged(w, row_bytes, row, spread, rows, c, tile),
                       whole ? stride : kTileBytes);
  }
  _tile_stored(0, &sums[0][0][0], 64);
  _tile_stored(1, &sums[1][0][0], 64);
  _tile_stored(2, &sums[2][0][0], 64);
  _tile_stored(3, &sums[3][0][0], 64);
}

// As block, for weights made per tile: decode(c, tile) writes bytes [c, c + 64) of the block's 16
// rows (`row_bytes` each, a multiple of 64) into `tile`, which the tile unit then loads from L1
// (two tiles in turns, so that decoding the next does not wait for the load of the last).
template <Dot kDot, typename Sum, typename Decode>
inline void decoded_block(int64_t row_bytes, const PackedX& x, const Decode& decode, Sum (&sums)[kSums][kTile][kTile]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  alignas(64) uint8_t tiles[2][kTile][kTileBytes];
  for (int64_t c = 0; c < row_bytes; c += kTileBytes) {
    const int64_t i = c / kTileBytes;
    decode(c, tiles[i & 1]);
    multiply_any<kDot>(i, x, c, &tiles[i & 1][0][0], kTileBytes);
  }
  _tile_stored(0, &sums[0][0][0], 64);
  _tile_stored(1, &sums[1][0][0], 64);
  _tile_stored(2, &sums[2][0][0], 64);
  _tile_stored(3, &sums[3][0][0], 64);
}

// A block's 16 weight rows lie n / 16 rows apart (rounded up: `spread`), and block b holds rows b,
// b + spread, ..: each of a tile's 16 rows then continues where the previous block's left off, so
// a thread's blocks read 16 long sequential streams, which the hardware prefetchers follow. Blocks
// of 16 neighbouring rows read the 0.5B's bf16 rows of 896 values (1.8 KB) in 16 short streams per
// 28 KB: 26.6 GB/s against 31.2 spread this way (2 threads, a plain read 30.3; software
// prefetching measured slower on this path). `body(b0, b1)` runs blocks [b0, b1) of one task with
// the tiles configured for m x rows.
inline int64_t spread_of(int64_t n) { return (n + kTile - 1) / kTile; }
inline int64_t rows_of_block(int64_t b, int64_t n, int64_t spread) {
  return std::min(kTile, (n - b + spread - 1) / spread);
}
template <typename Body>
void blocks_in_parallel(int64_t n, int64_t row_bytes, int64_t m, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, 65536 / (kTile * row_bytes));  // ~64 KiB of weights per task
  at::parallel_for(0, spread_of(n), grain, [&](int64_t b0, int64_t b1) {
    configure(m);
    body(b0, b1);
    _tile_release();
  });
}

// Output y[j, start + q] for q < count (<= 16) of x row j: fp32 (Y = float) or rounded to bf16.
template <typename Y>
inline void store_outputs(Y* y, int64_t n, int64_t j, int64_t start, int64_t count, __m512 value) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  if constexpr (std::is_same_v<Y, float>) {
    _mm512_mask_storeu_ps(y + j * n + start, mask, value);
  } else {
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(simd::round_to_bf16(value)), 16);
    _mm256_mask_storeu_epi16(y + j * n + start, mask, _mm512_cvtepi32_epi16(bits));
  }
}

// The four sums of a block in a fixed order: total[i][j] = ((s0 + s1) + s2) + s3.
inline void add_sums(const float (&sums)[kSums][kTile][kTile], float (&total)[kTile][kTile]) {
  for (int64_t i = 0; i < kTile; ++i)
    _mm512_store_ps(total[i], _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_load_ps(sums[0][i]),
                                                                       _mm512_load_ps(sums[1][i])),
                                                         _mm512_load_ps(sums[2][i])),
                                           _mm512_load_ps(sums[3][i])));
}

// A bf16 product on the tiles, y [m, n] fp32 (Y = float) or rounded to bf16 (Y = uint16_t), y[j,
// row] = the block's total for that weight row and x row j (+ bias). Each task calls `task()`
// once for its block function, block(b, rows, sums), which leaves the four sums of block b (its
// `rows` weight rows against every x row) in `sums`. kSpread: block b holds weight rows b + i *
// spread (see above), and the totals of 16 consecutive blocks are kept, so that each x row's
// outputs are written 16 neighbours at a time; else block b holds rows 16 b + i.
template <bool kSpread, typename Y, typename Task>
void bf16_blocks(int64_t m, int64_t n, int64_t row_bytes, const float* bias, Y* y, const Task& task) {
  const int64_t spread = spread_of(n);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // lane q: element [q][0][0] of a [16][16][16] array, or [q][0] of a [16][16] one
  const __m512i blocks_apart = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(kTile * kTile));
  const __m512i rows_apart = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(kTile));
  auto biases = [&](int64_t start, int64_t count) {
    return bias ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), bias + start) : _mm512_setzero_ps();
  };
  blocks_in_parallel(n, row_bytes, m, [&](int64_t b0, int64_t b1) {
    auto block_of = task();
    alignas(64) float sums[kSums][kTile][kTile];
    if constexpr (!kSpread) {
      alignas(64) float total[kTile][kTile];  // [weight row i of the block][x row j]
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * kTile, count = std::min(kTile, n - start);
        block_of(b, count, sums);
        add_sums(sums, total);
        const __m512 bias_rows = biases(start, count);
        for (int64_t j = 0; j < m; ++j)
          store_outputs(y, n, j, start, count,
                        _mm512_add_ps(_mm512_i32gather_ps(rows_apart, &total[0][j], 4), bias_rows));
      }
      return;
    }
    alignas(64) float kept[kTile][kTile][kTile];  // [block q of 16][weight row i of the block][x row j]
    for (int64_t first = b0; first < b1; first += kTile) {
      const int64_t count = std::min(kTile, b1 - first);
      for (int64_t q = 0; q < count; ++q) {
        block_of(first + q, rows_of_block(first + q, n, spread), sums);
        add_sums(sums, kept[q]);
      }
      // Weight rows first + q + i * spread for q < count are neighbours in y: one store per x row.
      for (int64_t i = 0; i < kTile && first + i * spread < n; ++i) {
        const int64_t start = first + i * spread, outputs = std::min(count, n - start);
        const __m512 bias_rows = biases(start, outputs);
        for (int64_t j = 0; j < m; ++j)
          store_outputs(y, n, j, start, outputs,
                        _mm512_add_ps(_mm512_i32gather_ps(blocks_apart, &kept[0][i][j], 4), bias_rows));
      }
    }
  });
}

// bf16 weights [n, k] as they lie: each block's tiles are loaded from the weight rows in place.
inline void bf16(const uint16_t* x_rows, const uint16_t* w, int64_t m, int64_t k, int64_t n, const float* bias,
                 uint16_t* y) {
  const PackedX x(x_rows, m, m, k * 2, k * 2);
  const int64_t spread = spread_of(n);
  const auto* bytes = reinterpret_cast<const uint8_t*>(w);
  bf16_blocks<true>(m, n, k * 2, bias, y, [&] {
    return [&](int64_t b, int64_t rows, float (&sums)[kSums][kTile][kTile]) {
      block<Dot::kBf16>(bytes, k * 2, b, spread, rows, x, sums);
    };
  });
}

// LLM.int8()'s int32 sums on the tiles, exactly: x holds m rows of signed int8 values, `x_stride`
// bytes apart, zero-padded to whole tile rows. Each task calls `task()` once for its row handler
// and hands it every weight row r of its blocks with that row's m sums (codes row r . x row j),
// right after the block, while the row is still in the cache (LLM.int8() then reads its outlier
// columns). More than 16 x rows (prefills) go in groups of 16, the last padded with zero rows,
// each against the block while it is in the cache.
template <typename Task>
void int8_rows(const int8_t* codes, int64_t k, int64_t n, const int8_t* x_rows, int64_t m, int64_t x_stride,
               const Task& task) {
  const int64_t width = std::min(m, kTile);  // x rows of a B tile
  std::vector<PackedX> groups;
  for (int64_t j0 = 0; j0 < m; j0 += width)
    groups.emplace_back(x_rows + j0 * x_stride, width, std::min(width, m - j0), x_stride, x_stride);
  const int64_t spread = spread_of(n);
  blocks_in_parallel(n, k, width, [&](int64_t b0, int64_t b1) {
    auto handle = task();
    alignas(64) int32_t tiles[kSums][kTile][kTile];
    std::vector<int32_t> sums(kTile * m);  // [weight row i of the block][x row j]
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = rows_of_block(b, n, spread);
      for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
        block<Dot::kInt8>(reinterpret_cast<const uint8_t*>(codes), k, b, spread, rows, groups[g], tiles);
        const int64_t j0 = g * width, valid = std::min(width, m - j0);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < valid; ++j)
            sums[i * m + j0 + j] = tiles[0][i][j] + tiles[1][i][j] + tiles[2][i][j] + tiles[3][i][j];
      }
      for (int64_t i = 0; i < rows; ++i) handle(b + i * spread, sums.data() + i * m);
    }
  });
}

}  // namespace tgi::amx

#endif  // AMX
