// bitsandbytes' quantized products, read in bitsandbytes' own layouts, computing what
// bitsandbytes 0.50 computes on the CPU.
//
// 4-bit (Linear4bit, nf4 and fp4): bitsandbytes dequantizes the whole weight, w = table[code] *
// absmax[block] in fp32 (rounded to bf16 when the compute dtype is bf16), then calls F.linear. Here
// each chunk of codes is decoded in registers (a 16-entry table lookup) and multiplied with every x
// row while there: the weight stream is 4.5 bits per weight instead of 32. AVX-512 builds decode
// exactly bitsandbytes' w values (the table scaled by the block's absmax), so only the order of the
// fp32 sums differs from bitsandbytes; AVX2 builds with an fp32 compute dtype sum t * x over an
// absmax block and scale that sum once (four_bit_tile), which also rounds differently. With a bf16
// compute dtype the avx512_bf16 variant rounds the decoded weights to bf16 (as bitsandbytes does)
// and multiplies them with the bf16 pair dot product, as bitsandbytes' bf16 matmul would: the
// products are exact either way, two per instruction instead of one (against rounding in fp32
// lanes: 0.72-0.73x the time at one x row, 0.58-0.76x at 2-16 rows); on a Zen 4). The amx variant
// multiplies 2-16 x rows on AMX tiles, decoding 16 weight rows to bf16 one tile at a time (8 rows:
// 0.56x the time of the fp32 lanes on a Sapphire-Rapids-class Xeon, whose vdpbf16ps is slow).
//
// int8 (Linear8bitLt, LLM.int8() with threshold t, 6.0 by default): bitsandbytes casts x to
// fp16; a column whose |x| >= t in any row is an outlier column; each row's scale is the absmax
// of its fp16 values below t; x is quantized row-wise, round(x16 * (127 / absmax)), outlier
// columns set to 0; the int8 product with CB [n, k] is summed exactly in int32 and dequantized
// as acc * (absmax_row * SCB_n) * 6.200124e-05 (+ bias); the outlier columns are added back in
// the input precision against CB * SCB * (1 / 127). The same steps run here in the same order
// of fp32 operations, with one difference: a row's outlier columns are its own (|x| >= t in that
// row), not those of any row of the batch, so a row's result does not depend on the rows beside
// it (verified mode: a verification equals its one-token steps). For one x row, and for rows
// whose outliers lie in the same columns, the result equals bitsandbytes' up to the order of the
// outlier sum.
// With TGI_QUANTIZED_ACTIVATIONS=int8 (q8 below) 4-bit weights, and the weight-only int8 blocks
// of the lm_head, multiply int8-quantized activations instead, as llama.cpp does: not bitsandbytes'
// numerics.
// The int8 dot products: AVX2 and AVX-512BW move x's sign onto w and sum |x| * w with maddubs
// (|x|, |w| <= 127: pairs never saturate); AVX-512 VNNI sums (x + 128) * w with vpdpbusd and
// takes back 128 * sum(w) (each weight row's sum is kept with the weight); AMX's TDPBSSD multiplies
// x and w as they are, 16 weight rows x all x rows per instruction (amx.h). A weight chunk is
// loaded once for a tile of x rows.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "blocks.h"
#include "kernels.h"

namespace tgi {
namespace {

using blocks::Prepared;
using simd::F;
using simd::I;

// ---- 4-bit ------------------------------------------------------------------------------------
// A chunk is 32 weights (16 bytes of codes, one absmax block: blocksizes are powers of two >= 32),
// decoded to kVectors fp32 vectors in the order below; x is prepared in the same order.
#if defined(__AVX512F__)
constexpr int kVectors = 2;  // [even elements 0..30], [odd elements 1..31]: high, low nibbles

// The position within a chunk that lane p of the decoded vectors holds.
inline int64_t source(int64_t p) { return p < 16 ? 2 * p : 2 * (p - 16) + 1; }

// The table is scaled by the block's absmax once per chunk (the same fp32 products bitsandbytes
// computes per weight; rounded once to bf16 for a bf16 compute dtype), then looked up: one
// permute per 16 weights.
struct Decoder {
  F table;
  explicit Decoder(const float* values) : table(_mm512_loadu_ps(values)) {}
  template <bool kRound>
  void fp32(const uint8_t* codes, F scale, F (&out)[kVectors]) const {
    F values = _mm512_mul_ps(table, scale);
    if constexpr (kRound) values = simd::round_to_bf16(values);
    const I bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    out[0] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
    out[1] = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), values);
  }
#if defined(__AVX512BF16__)
  // The chunk as 32 bf16 values in the same order: the scaled table rounded to bf16 by one
  // instruction (ties to even, as bitsandbytes rounds; denormals flush to zero, as vdpbf16ps reads
  // its inputs anyway), then one 16-bit permute.
  __m512i bf16(const uint8_t* codes, F scale) const {
    const __m256i values = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(table, scale)));
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(words, 4)),
                                             _mm256_and_si256(words, _mm256_set1_epi16(15)), 1);
    return _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(values));
  }
#endif
};
#else
// AVX2 has no 16-entry fp32 permute: the table is split into its 4 byte planes, each looked up
// with one byte shuffle (lane 0: high nibbles, lane 1: low nibbles), and the bytes are
// interleaved back into fp32 lanes. Vector q holds [elements 8q, 8q+2, 8q+4, 8q+6 | 8q+1, .., 8q+7].
constexpr int kVectors = 4;

inline int64_t source(int64_t p) {
  const int64_t q = p / 8, j = p % 8;
  return 8 * q + (j < 4 ? 2 * j : 2 * (j - 4) + 1);
}

struct Decoder {
  I planes[4];
  const float* values;  // the 16 table values
  explicit Decoder(const float* table) : values(table) {
    alignas(16) uint8_t bytes[4][16];
    for (int e = 0; e < 16; ++e) {
      uint32_t bits;
      std::memcpy(&bits, values + e, sizeof(bits));
      for (int b = 0; b < 4; ++b) bytes[b][e] = static_cast<uint8_t>(bits >> (8 * b));
    }
    for (int b = 0; b < 4; ++b)
      planes[b] = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes[b])));
  }
  // Lane 0: the high nibbles of the chunk's 16 bytes, lane 1: the low ones.
  static I indices(const uint8_t* codes) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i low4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(packed, low4), _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
  }
  // The table's values (unscaled).
  void unscaled(const uint8_t* codes, F (&out)[kVectors]) const {
    const I index = indices(codes);
    const I p0 = _mm256_shuffle_epi8(planes[0], index), p1 = _mm256_shuffle_epi8(planes[1], index);
    const I p2 = _mm256_shuffle_epi8(planes[2], index), p3 = _mm256_shuffle_epi8(planes[3], index);
    const I b01_low = _mm256_unpacklo_epi8(p0, p1), b01_high = _mm256_unpackhi_epi8(p0, p1);
    const I b23_low = _mm256_unpacklo_epi8(p2, p3), b23_high = _mm256_unpackhi_epi8(p2, p3);
    out[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(b01_low, b23_low));
    out[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(b01_low, b23_low));
    out[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(b01_high, b23_high));
    out[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(b01_high, b23_high));
  }
  // A block's 16 values scaled by its absmax and rounded to bf16, as bitsandbytes rounds them for a
  // bf16 compute dtype: their lower 16 bits are 0, so two byte planes (bytes 2 and 3) hold them,
  // built once per block instead of a product and a rounding per weight (one x row of the 0.5B's
  // products: 0.82x the time, in pairs of weight rows; a block of 4 spilled the planes).
  struct Bf16Planes {
    I byte2, byte3;
  };
  Bf16Planes bf16_planes(float absmax) const {
    // Each value's bf16 bits as a word (values 8h .. 8h + 7 in words[h]), then their low bytes in
    // one plane and their high bytes in the other.
    __m128i words[2];
    for (int h = 0; h < 2; ++h) {
      const I bits = _mm256_srli_epi32(
          _mm256_castps_si256(simd::round_to_bf16(_mm256_mul_ps(_mm256_loadu_ps(values + 8 * h), simd::set1(absmax)))),
          16);
      words[h] = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    }
    const __m128i low = _mm_set1_epi16(0xff);
    return {_mm256_broadcastsi128_si256(_mm_packus_epi16(_mm_and_si128(words[0], low), _mm_and_si128(words[1], low))),
            _mm256_broadcastsi128_si256(_mm_packus_epi16(_mm_srli_epi16(words[0], 8), _mm_srli_epi16(words[1], 8)))};
  }
  // The chunk's values from its block's planes, in unscaled()'s order.
  static void bf16_values(const uint8_t* codes, const Bf16Planes& planes, F (&out)[kVectors]) {
    const I index = indices(codes), zero = _mm256_setzero_si256();
    const I b2 = _mm256_shuffle_epi8(planes.byte2, index), b3 = _mm256_shuffle_epi8(planes.byte3, index);
    const I low = _mm256_unpacklo_epi8(b2, b3), high = _mm256_unpackhi_epi8(b2, b3);
    out[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, low));
    out[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, low));
    out[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, high));
    out[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, high));
  }
  template <bool kRound>
  void fp32(const uint8_t* codes, F scale, F (&out)[kVectors]) const {
    unscaled(codes, out);
    for (auto& v : out) {
      v = _mm256_mul_ps(v, scale);
      if constexpr (kRound) v = simd::round_to_bf16(v);
    }
  }
};
#endif

constexpr int64_t kChunk4 = 32;

struct FourBit {
  const Packed4& w;
  Decoder decoder;
  int shift;  // log2(blocksize)
  int64_t k;

  const uint8_t* codes(int64_t row, int64_t c) const {
    const uint8_t* p = w.codes + (row * k + c) / 2;
    if ((c & 127) == 0) simd::prefetch_ahead(p);  // a cache line of codes per 128 weights
    return p;
  }
  float absmax(int64_t row, int64_t c) const { return w.absmax[(row * k + c) >> shift]; }
  F scale(int64_t row, int64_t c) const { return simd::set1(absmax(row, c)); }
  bool starts_block(int64_t row, int64_t c) const { return ((row * k + c) & (w.blocksize - 1)) == 0; }
  template <bool kRound>
  void chunk(int64_t row, int64_t c, F (&out)[kVectors]) const {
    decoder.fp32<kRound>(codes(row, c), scale(row, c), out);
  }
#if defined(__AVX512BF16__)
  __m512i chunk_bf16(int64_t row, int64_t c) const { return decoder.bf16(codes(row, c), scale(row, c)); }
#endif
};

// x rows in the decoder's order, as one fp32 product expects them.
Prepared<float> prepare_4bit(const float* x, int64_t m, int64_t k) {
  Prepared<float> out(m, k, kChunk4);
  for (int64_t j = 0; j < m; ++j)
    for (int64_t c = 0; c < k; c += kChunk4)
      for (int64_t p = 0; p < kChunk4; ++p) out.row(j)[c + p] = x[j * k + c + source(p)];
  return out;
}

// The few-row product (blocks.h) on weight rows row .. row + rows decoded into `decoded` (fp32
// values, or bf16 bits for the bf16 products; its row 0 is weight row `row`: y and bias are offset
// to match). Never inlined: inlined into four_bit's loop beside the decoder, GCC kept the AVX-512
// 4 x 4 tile's 16 sums on the stack and stored all of them on every chunk (4-16 x rows ran 1.6-2x
// slower).
template <typename X>
[[gnu::noinline]] void decoded_rows(const X* decoded, const Prepared<X>& x, int64_t m, int64_t k, const float* bias,
                                    float* y, int64_t n, int64_t row, int64_t rows) {
  using W = std::conditional_t<std::is_same_v<X, float>, blocks::F32Weights, blocks::Bf16Weights>;
  const W dense{decoded, k};
  const float* block_bias = bias ? bias + row : nullptr;
  if (rows == blocks::kRows) {
    blocks::rows_against_all_x<W, blocks::kRows>(dense, x, m, k, y + row, n, 0, block_bias);
  } else {
    for (int64_t r = 0; r < rows; ++r) blocks::rows_against_all_x<W, 1>(dense, x, m, k, y + row, n, r, block_bias);
  }
}

// x rows m0 .. m0 + MT against weight rows row .. row + R (R = kRows, 2 or 1), each chunk decoded in
// registers once and multiplied with every x row of the tile while there. Each (weight row, x row)
// pair is summed in one order whatever the tile: chunk after chunk, kLanes values at a time (the
// few-row product's order on blocks decoded into a buffer, decoded_rows), finished by
// blocks::store, whose horizontal sums depend only on whether the row lies in a block of kRows
// (R = 4 or 2) or past the last one (R = 1). So a row's output is the same bit for bit alone or
// beside other x rows: a verification equals its one-token steps.
// On AVX2 with an fp32 compute dtype the table's values are multiplied with x and the sums of an
// absmax block scaled once (sum(t * x) * absmax, not sum((t * absmax) * x) as bitsandbytes
// computes: other roundings, the same value up to them; one product per weight less, ~0.9x the
// one-row time); with a bf16 compute dtype each block's 16 values are scaled and rounded to bf16
// once (Decoder::bf16_planes), the values bitsandbytes multiplies.
template <bool kRound, int R, int MT>
void four_bit_tile(const FourBit& w, const Prepared<float>& x, int64_t m0, const float* bias, float* y, int64_t n,
                   int64_t row) {
#if defined(__AVX512F__)
  constexpr bool kFactored = false;
#else
  constexpr bool kFactored = !kRound;
  [[maybe_unused]] Decoder::Bf16Planes planes[R];  // kRound: each row's current block
#endif
  F acc[R][MT], part[R][MT];  // part: the current absmax block's sums (kFactored)
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = part[r][j] = simd::zero();
  [[maybe_unused]] auto scale_part = [&](int r, int64_t c) {  // part[r] holds the block of chunk c
    const F scale = w.scale(row + r, c);
    for (int j = 0; j < MT; ++j) {
      acc[r][j] = simd::fmadd(part[r][j], scale, acc[r][j]);
      part[r][j] = simd::zero();
    }
  };
  for (int64_t c = 0; c < w.k; c += kChunk4)
    for (int r = 0; r < R; ++r) {
      F v[kVectors];
#if defined(__AVX512F__)
      w.chunk<kRound>(row + r, c, v);
#else
      if (c == 0 || w.starts_block(row + r, c)) {  // a row's first chunk may lie inside a block
        if constexpr (kRound) {
          planes[r] = w.decoder.bf16_planes(w.absmax(row + r, c));
        } else if (c > 0) {
          scale_part(r, c - kChunk4);
        }
      }
      if constexpr (kRound) {
        Decoder::bf16_values(w.codes(row + r, c), planes[r], v);
      } else {
        w.decoder.unscaled(w.codes(row + r, c), v);
      }
#endif
      F(&sums)[MT] = kFactored ? part[r] : acc[r];
      for (int j = 0; j < MT; ++j) {
        const float* xj = x.row(m0 + j) + c;
        for (int i = 0; i < kVectors; ++i) sums[j] = simd::fmadd(v[i], simd::load(xj + i * simd::kLanes), sums[j]);
      }
    }
  if constexpr (kFactored)
    for (int r = 0; r < R; ++r) scale_part(r, w.k - kChunk4);
  blocks::store<R, MT>(acc, y, n, m0, row, bias);
}

#if defined(__AVX512F__)
constexpr int64_t kDirectRows = 1;  // more x rows: blocks decoded into a buffer first (decoded_rows)
#else
constexpr int64_t kDirectRows = std::numeric_limits<int64_t>::max();
#endif

// x rows against weight rows row .. row + R (R = kRows or 1), no decoded buffer: one x row against
// the whole block (but with bf16 planes), more in tiles of up to 6 against pairs of its rows
// (AVX2's 16 vector registers: a tile's sums, block sums or planes, the decoded chunk). On the
// 0.5B's shapes (2 threads, a Zen 3, fp32 compute) 2 / 3 / 4 / 6 / 8 x rows took 1.2-1.4 / 1.6-1.9 /
// 1.8-2.6 / 2.3-2.5 / 3.5-4.8x one row's time (kernel_products.py --shapes qwen0.5b, noisy runs),
// where decoding blocks into a buffer first (as AVX-512 builds do) took 1.67 / 1.93 / 2.08 / 2.53 /
// 3.25x of a slower row; each x row adds 4 vector FMAs per 32 weights to the decode they share.
template <bool kRound, int R>
void four_bit_direct(const FourBit& w, const Prepared<float>& x, int64_t m, const float* bias, float* y, int64_t n,
                     int64_t row) {
  constexpr int kPair = R == 1 ? 1 : 2;
#if defined(__AVX512F__)
  constexpr bool kWholeBlock = true;
#else
  constexpr bool kWholeBlock = !kRound;  // a block's 4 rows of bf16 planes spilled (1.27x the time of pairs)
#endif
  if (m == 1 && kWholeBlock) {
    four_bit_tile<kRound, R, 1>(w, x, 0, bias, y, n, row);
    return;
  }
  for (int r = 0; r < R; r += kPair)
    blocks::for_tiles<6>(m, [&](auto size, int64_t m0) {
      four_bit_tile<kRound, kPair, decltype(size)::value>(w, x, m0, bias, y, n, row + r);
    });
}

template <bool kRound>
inline void decode_into(const FourBit& w, int64_t row, int64_t c, float* out) {
  F v[kVectors];
  w.chunk<kRound>(row, c, v);
  for (int i = 0; i < kVectors; ++i) simd::store(out + i * simd::kLanes, v[i]);
}

#if defined(__AVX512BF16__)
// bf16 compute dtype in the avx512_bf16 variant: chunks decoded to bf16 (Decoder::bf16) and
// multiplied with vdpbf16ps (kRound is implied: bf16 values are rounded values).
template <bool kRound>
inline void decode_into(const FourBit& w, int64_t row, int64_t c, uint16_t* out) {
  _mm512_storeu_si512(out, w.chunk_bf16(row, c));
}

// One x row of bf16 values against R weight rows: 16 products per vdpbf16ps into one sum per
// row, in the order of the few-row product's Bf16Weights (see four_bit_tile).
template <bool kRound, int R>
void four_bit_one_row(const FourBit& w, const uint16_t* x, const float* bias, float* y, int64_t n, int64_t row) {
  __m256 acc[R][1];
  for (auto& a : acc) a[0] = _mm256_setzero_ps();
  for (int64_t c = 0; c < w.k; c += kChunk4)
    for (int r = 0; r < R; ++r) {
      const __m512i both = w.chunk_bf16(row + r, c);
      const __m256i v[2] = {_mm512_castsi512_si256(both), _mm512_extracti64x4_epi64(both, 1)};
      for (int i = 0; i < 2; ++i) {
        const __m256i xi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c + 16 * i));
        acc[r][0] = _mm256_dpbf16_ps(acc[r][0], reinterpret_cast<__m256bh>(v[i]), reinterpret_cast<__m256bh>(xi));
      }
    }
  blocks::store<R, 1>(acc, y, n, 0, row, bias);
}

// x rows (bf16 values, widened to fp32) in the decoder's order, as bf16.
Prepared<uint16_t> narrow_prepared(const Prepared<float>& x, int64_t m, int64_t k) {
  Prepared<uint16_t> out(m, k, kChunk4);
  for (int64_t j = 0; j < m; ++j)
    for (int64_t c = 0; c < x.padded_k; c += simd::kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.row(j) + c),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(simd::load(x.row(j) + c))));
  return out;
}
#endif

#if defined(TGI_AMX)
// bf16 compute dtype on AMX, 2-16 x rows: each block of 16 neighbouring weight rows decoded to
// bf16, as bitsandbytes rounds them, one tile (32 values of each row) at a time, and multiplied on
// the tiles against every x row (x in the decoder's order, which the decoded rows share). Rows
// n / 16 apart (as the dense tiles read them) decoded 11% slower: 16 short code streams.
void four_bit_tiles(const FourBit& w, const Prepared<uint16_t>& x, int64_t m, const float* bias, float* y, int64_t n) {
  const int64_t k = w.k;
  const amx::PackedX packed(x.row(0), m, m, x.padded_k * 2, k * 2);
  amx::bf16_blocks<false>(m, n, k / 2, bias, y, [&] {
    return [&](int64_t b, int64_t rows, float (&sums)[amx::kSums][amx::kTile][amx::kTile]) {
      auto decode = [&](int64_t c, uint8_t (&tile)[amx::kTile][amx::kTileBytes]) {
        for (int64_t i = 0; i < rows; ++i) _mm512_store_si512(tile[i], w.chunk_bf16(b * amx::kTile + i, c / 2));
        for (int64_t i = rows; i < amx::kTile; ++i) std::memset(tile[i], 0, amx::kTileBytes);
      };
      amx::decoded_block<amx::Dot::kBf16>(k * 2, packed, decode, sums);
    };
  });
}
#endif

// Several x rows: blocks of rows decoded once into an L1-sized buffer (fp32, or bf16 for the bf16
// products: X = uint16_t), then the few-row product runs on it.
template <bool kRound, typename X>
void four_bit_rows(const FourBit& w, const Prepared<X>& x, int64_t m, const float* bias, float* y, int64_t n,
                   int64_t row, int64_t rows, simd::Buffer<X>& decoded) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < w.k; c += kChunk4) decode_into<kRound>(w, row + r, c, decoded.data() + r * w.k + c);
  decoded_rows(decoded.data(), x, m, w.k, bias, y, n, row, rows);
}

template <bool kRound, typename X>
void four_bit(const FourBit& w, const Prepared<X>& x, int64_t m, const float* bias, float* y, int64_t n) {
  const int64_t blocks = (n + blocks::kRows - 1) / blocks::kRows;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, blocks::kRows * w.k / 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t end = std::min(n, b1 * blocks::kRows);
    int64_t row = b0 * blocks::kRows;
    if constexpr (std::is_same_v<X, float>) {
      if (m <= kDirectRows) {
        for (; row + blocks::kRows <= end; row += blocks::kRows)
          four_bit_direct<kRound, blocks::kRows>(w, x, m, bias, y, n, row);
        for (; row < end; ++row) four_bit_direct<kRound, 1>(w, x, m, bias, y, n, row);
        return;
      }
    } else if (m == 1) {
      for (; row + blocks::kRows <= end; row += blocks::kRows)
        four_bit_one_row<kRound, blocks::kRows>(w, x.row(0), bias, y, n, row);
      for (; row < end; ++row) four_bit_one_row<kRound, 1>(w, x.row(0), bias, y, n, row);
      return;
    }
    simd::Buffer<X> decoded(blocks::kRows * w.k);
    for (int64_t row = b0 * blocks::kRows; row < end; row += blocks::kRows)
      four_bit_rows<kRound>(w, x, m, bias, y, n, row, std::min<int64_t>(blocks::kRows, end - row), decoded);
  });
}

// ---- int8 activations (TGI_QUANTIZED_ACTIVATIONS=int8) -----------------------------------------
// As llama.cpp multiplies its quantized blocks: each 32 values of an x row quantized to int8
// (scale max|x| / 127, rounded to nearest even), the weights as int8 (bitsandbytes 4-bit: its 16
// table values as round(t * 127 / max|t|); weight-only int8 blocks: their codes), each chunk's 32
// products summed exactly in int32 and converted once, as llama.cpp converts a block's sum, then
// scaled by the chunk's x scale; a weight block's sum is scaled once, at its end (tile: the fp32
// steps). Integer chunk sums are exact, and every (weight row, x row) pair runs the same fp32
// steps in the same order on every path and variant: a row's result never depends on the rows
// beside it, nor on the kernels that ran it. Other numerics than bitsandbytes' (README: the
// guarantee paragraph). 256-bit lanes in every variant: AVX2 multiplies |x| by w with x's sign
// (maddubs, then madd: 8 lanes of 4 products), AVX-512 VNNI unsigned w + 128 by signed x
// (vpdpbusd, each lane started at -128 * its 4 x values' sum, made once per x chunk: the same
// lanes); the amx variant multiplies several x rows on AMX tiles (amx_product).
namespace q8 {

#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
constexpr char kBias = kVnni ? static_cast<char>(0x80) : 0;  // added to each weight byte (vpdpbusd's w is unsigned)

constexpr int64_t kChunk = 32;
constexpr int kTile = 2;  // x rows per tile against pairs of weight rows (two sums per pair)

// 4-bit codes: the chunk's 32 nibbles as byte indices, lane 0 the high nibbles (elements 0, 2, ..,
// 30), lane 1 the low ones (elements 1, 3, .., 31); x is quantized in that order. The 16 bytes are
// loaded into both lanes, lane 0 shifted right by 4: no lane-crossing shuffle.
struct FourBitRows {
  const Packed4& w;
  int64_t k;
  __m256i table;  // the 16 values as int8 in each lane
  float scale;    // max|t| / 127: t ~ int8 * scale
  static constexpr bool kReordered = true;
  static constexpr int64_t kChunkBytes = kChunk / 2;
  static constexpr int64_t kLineColumns = 128;  // columns per cache line of codes
  // fewer x rows: the lanes (0.5B-shaped layers: 2 rows 14.2-14.6 ms on AMX tiles, 15.1-15.7 on lanes)
  static constexpr int64_t kAmxRows = 2;
  FourBitRows(const Packed4& packed, int64_t k_) : w(packed), k(k_) {
    float top = 0.0f;
    for (int e = 0; e < 16; ++e) top = std::max(top, std::fabs(w.table[e]));
    scale = top / 127.0f;
    alignas(16) int8_t t[16];
    for (int e = 0; e < 16; ++e)
      t[e] = static_cast<int8_t>(static_cast<int8_t>(top > 0.0f ? std::nearbyint(w.table[e] * (127.0f / top)) : 0.0f) ^
                                 kBias);
    table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  }
  const uint8_t* row(int64_t r) const { return w.codes + r * k / 2; }
  __m256i chunk(const uint8_t* codes) const {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m256i shifted = _mm256_srlv_epi64(both, _mm256_setr_epi64x(4, 4, 0, 0));
    return _mm256_shuffle_epi8(table, _mm256_and_si256(shifted, _mm256_set1_epi8(15)));
  }
  int shift() const { return __builtin_ctzll(w.blocksize); }  // blocksize: a power of two
  const float* block_scales() const { return w.absmax; }
#if defined(__AVX512BW__)
  // Two chunks at once (biased as chunk()): their 32 bytes as [first, first, second, second], lanes
  // 0 and 2 shifted by 4.
  __m512i chunk_pair(const uint8_t* codes) const {
    const __m512i both = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i nibbles = _mm512_and_si512(
        _mm512_srlv_epi64(_mm512_shuffle_i64x2(both, both, 0x50), _mm512_set_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
        _mm512_set1_epi8(15));
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_castsi256_si128(table)), nibbles);
  }
#endif
  // Weight rows row0 .. row0 + rows as signed int8 [16, k] (the missing rows zero), in the order x
  // is quantized: written to `out`, or the rows in place where they need no copy (Int8Rows).
  const int8_t* rows_for_tiles(int64_t row0, int64_t rows, int8_t* out) const {
#if defined(__AVX512BW__)
    const int64_t pairs = k / (2 * kChunk) * (2 * kChunk);
    for (int64_t i = 0; i < rows; ++i) {
      const uint8_t* codes = row(row0 + i);
      for (int64_t c = 0; c < pairs; c += 2 * kChunk)
        _mm512_storeu_si512(out + i * k + c, _mm512_xor_si512(chunk_pair(codes + c / 2), _mm512_set1_epi8(kBias)));
      if (pairs < k)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * k + pairs),
                            _mm256_xor_si256(chunk(codes + pairs / 2), _mm256_set1_epi8(kBias)));
    }
#else
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < k; c += kChunk)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * k + c),
                            _mm256_xor_si256(chunk(row(row0 + i) + c / 2), _mm256_set1_epi8(kBias)));
#endif
    std::memset(out + rows * k, 0, (16 - rows) * k);
    return out;
  }
};

// Weight-only int8 in blocks along k (within rows): w = code * scales[block].
struct Int8Rows {
  const int8_t* codes;
  const float* scales;
  int64_t k, blocksize;  // a power of two
  static constexpr bool kReordered = false;
  static constexpr int64_t kChunkBytes = kChunk;
  static constexpr int64_t kLineColumns = 64;
  // fewer: the lanes (the 0.5B's int8 head: 2 / 3 / 4 / 8 rows 7.4 / 17.5 / 10.8 / 19.5 ms on lanes,
  // 10.2 / 10.9 / 11.2 / 12.1 on AMX tiles)
  static constexpr int64_t kAmxRows = 3;
  static constexpr float scale = 1.0f;
  const int8_t* row(int64_t r) const { return codes + r * k; }
  static __m256i chunk(const int8_t* row) {
    const __m256i values = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    return kVnni ? _mm256_xor_si256(values, _mm256_set1_epi8(kBias)) : values;
  }
#if defined(__AVX512BW__)
  static __m512i chunk_pair(const int8_t* row) {
    return _mm512_xor_si512(_mm512_loadu_si512(row), _mm512_set1_epi8(kBias));
  }
#endif
  int shift() const { return __builtin_ctzll(blocksize); }
  const float* block_scales() const { return scales; }
  const int8_t* rows_for_tiles(int64_t row0, int64_t rows, int8_t* out) const {  // as FourBitRows'
    if (rows == 16) return row(row0);
    std::memcpy(out, row(row0), rows * k);
    std::memset(out + rows * k, 0, (16 - rows) * k);
    return out;
  }
};

struct X {
  // [m, k / 32]: 32 values in the weights' order, then 32 bytes for the other operand: their
  // magnitudes (maddubs) or the 8 lanes' starting values, -128 * 4 values summed (VNNI)
  simd::Buffer<int8_t> chunks;
  std::vector<float> scales;    // [m, k / 32]
};

// reorder: each chunk in the 4-bit order (elements 0, 2, .., 30, then 1, 3, .., 31).
X quantize(const float* x, int64_t m, int64_t k, bool reorder) {
  X q{simd::Buffer<int8_t>(2 * m * k), std::vector<float>(m * k / kChunk)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // even bytes, then odd ones, in each lane (then the lanes' even halves first)
  const __m256i deinterleave =
      _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  at::parallel_for(0, m * k / kChunk, std::max<int64_t>(1, 4096 / kChunk), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      __m256 v[4];
      __m256 top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + c * kChunk + 8 * i);
        top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      }
      __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      t = _mm_max_ps(t, _mm_movehl_ps(t, t));
      const float most = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
      // max ignores a NaN: the chunk's scale carries it instead, so the row's outputs are NaN (as
      // fp32 products would make them), not finite values that hide it
      q.scales[c] = _mm256_testz_ps(nan, nan) ? most / 127.0f : std::numeric_limits<float>::quiet_NaN();
      const __m256 factor = _mm256_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
      __m256i words[4];
      for (int i = 0; i < 4; ++i) words[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], factor));
      // packs interleave the 128-bit lanes: the permute puts the 32 bytes back in order
      __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(words[0], words[1]), _mm256_packs_epi32(words[2], words[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      if (reorder) bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, deinterleave), 0xD8);
      int8_t* out = q.chunks.data() + 2 * c * kChunk;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
#if defined(__AVX512VNNI__)
      const __m256i start = _mm256_sub_epi32(
          _mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(kBias), bytes));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kChunk), start);
#else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kChunk), _mm256_abs_epi8(bytes));
#endif
    }
  });
  return q;
}

// One chunk's 32 products of weight values w (biased for VNNI) and an x chunk (s: its values; u:
// their magnitudes, or VNNI's lane starts), exactly, as 8 int32 lanes of 4 neighbouring products.
inline __m256i chunk_sums(__m256i w, __m256i s, __m256i u) {
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(u, w, s);  // u: the lanes' starting values
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(w, s)), _mm256_set1_epi16(1));
#endif
}

// The lanes of a, b, c and d summed: [sum a, sum b, sum c, sum d] (exact: integers).
inline __m128i totals(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Weight rows row .. row + R against x rows j0 .. j0 + MT (R * MT <= 4 pairs, pair p = weight row
// row + p / MT and x row j0 + p % MT in lane p), one weight block (or the part of it in this row)
// after the other. Per pair, in fp32: part = fma(chunk sum, x scale, part) over the block's
// chunks from 0, acc = fma(part, block scale, acc) over the blocks from 0, y = acc * w.scale (+
// bias): the steps of every other q8 path (amx below), so no result depends on the path or the
// rows beside it. R > 1 only where k is a multiple of the blocksize (the rows' blocks then start
// at the same columns).
template <class W, int R, int MT>
void tile(const W& w, const X& x, int64_t k, int64_t j0, int64_t row, const float* bias, float* y, int64_t n) {
  static_assert(R * MT <= 4, "four pairs per tile: one __m128 of sums");
  __m128 acc = _mm_setzero_ps(), part = _mm_setzero_ps();
  // running pointers, one chunk on at a time (index arithmetic per chunk cost more than the products)
  decltype(w.row(0)) codes[R];
  for (int r = 0; r < R; ++r) codes[r] = w.row(row + r);
  const int8_t* chunks[MT];
  const float* scales[MT];
  for (int j = 0; j < MT; ++j) {
    chunks[j] = x.chunks.data() + 2 * (j0 + j) * k;
    scales[j] = x.scales.data() + (j0 + j) * k / kChunk;
  }
  const int shift = w.shift();
  const int64_t size = int64_t{1} << shift;
  const float* block_scales = w.block_scales();
  for (int64_t c = 0; c < k;) {
    const int64_t end = std::min(k, c + size - ((row * k + c) & (size - 1)));
    for (; c < end; c += kChunk) {
      __m256i s[MT], u[MT];
      for (int j = 0; j < MT; ++j) {
        s[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks[j]));
        u[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks[j] + kChunk));
      }
      __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                         _mm256_setzero_si256()};
      for (int r = 0; r < R; ++r) {
        if ((c & (W::kLineColumns - 1)) == 0 && j0 == 0) simd::prefetch_ahead(codes[r]);
        const __m256i values = w.chunk(codes[r]);
        for (int j = 0; j < MT; ++j) sums[r * MT + j] = chunk_sums(values, s[j], u[j]);
      }
      float xs[4] = {};
      for (int p = 0; p < R * MT; ++p) xs[p] = *scales[p % MT];
      part = _mm_fmadd_ps(_mm_cvtepi32_ps(totals(sums[0], sums[1], sums[2], sums[3])), _mm_loadu_ps(xs), part);
      for (int r = 0; r < R; ++r) codes[r] += W::kChunkBytes;
      for (int j = 0; j < MT; ++j) {
        chunks[j] += 2 * kChunk;
        ++scales[j];
      }
    }
    float ws[4] = {};
    for (int p = 0; p < R * MT; ++p) ws[p] = block_scales[((row + p / MT) * k + c - 1) >> shift];
    acc = _mm_fmadd_ps(part, _mm_loadu_ps(ws), acc);
    part = _mm_setzero_ps();
  }
  float out[4];
  _mm_storeu_ps(out, acc);
  for (int p = 0; p < R * MT; ++p) {
    float value = out[p] * w.scale;
    if (bias) value += bias[row + p / MT];
    y[(j0 + p % MT) * n + row + p / MT] = value;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// tile<W, 4, 1> (four weight rows, one x row) two chunks per instruction: each chunk's exact sum
// and the fp32 steps after it are tile()'s, in the same order, so the results are its bit for bit.
// Where k is a multiple of the blocksize and a block holds an even number of chunks.
template <class W>
void tile_pairs(const W& w, const X& x, int64_t k, int64_t row, const float* bias, float* y, int64_t n) {
  __m128 acc = _mm_setzero_ps(), part = _mm_setzero_ps();
  decltype(w.row(0)) codes[4];
  for (int r = 0; r < 4; ++r) codes[r] = w.row(row + r);
  const int8_t* chunks = x.chunks.data();  // per chunk: 32 values, then 32 lane-start bytes
  const float* scales = x.scales.data();
  const int shift = w.shift();
  const int64_t size = int64_t{1} << shift;
  const float* block_scales = w.block_scales();
  for (int64_t c = 0; c < k;) {
    for (const int64_t end = c + size; c < end; c += 2 * kChunk) {
      const __m512i first = _mm512_loadu_si512(chunks), second = _mm512_loadu_si512(chunks + 2 * kChunk);
      const __m512i s = _mm512_shuffle_i64x2(first, second, 0x44), u = _mm512_shuffle_i64x2(first, second, 0xEE);
      __m512i sums[4];
      for (int r = 0; r < 4; ++r) {
        if ((c & (W::kLineColumns - 1)) == 0) simd::prefetch_ahead(codes[r]);
        sums[r] = _mm512_dpbusd_epi32(u, w.chunk_pair(codes[r]), s);
        codes[r] += 2 * W::kChunkBytes;
      }
      // per 128-bit lane the four rows' sums, then lanes 0 + 1 (chunk c) and 2 + 3 (chunk c + 1)
      const auto pairs = [](__m512i a, __m512i b) {
        return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
      };
      const __m512i ab = pairs(sums[0], sums[1]), cd = pairs(sums[2], sums[3]);
      const __m512i lanes = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
      const __m512 both = _mm512_cvtepi32_ps(_mm512_add_epi32(lanes, _mm512_shuffle_i32x4(lanes, lanes, 0xB1)));
      part = _mm_fmadd_ps(_mm512_castps512_ps128(both), _mm_set1_ps(scales[0]), part);
      part = _mm_fmadd_ps(_mm512_extractf32x4_ps(both, 2), _mm_set1_ps(scales[1]), part);
      chunks += 4 * kChunk;
      scales += 2;
    }
    float ws[4];
    for (int r = 0; r < 4; ++r) ws[r] = block_scales[((row + r) * k + c - 1) >> shift];
    acc = _mm_fmadd_ps(part, _mm_loadu_ps(ws), acc);
    part = _mm_setzero_ps();
  }
  float out[4];
  _mm_storeu_ps(out, acc);
  for (int r = 0; r < 4; ++r) {
    float value = out[r] * w.scale;
    if (bias) value += bias[row + r];
    y[row + r] = value;
  }
}
#endif

// Weight rows row .. row + R against every x row, in tiles of up to kTile x rows.
template <class W, int R>
void rows(const W& w, const X& x, int64_t m, int64_t k, int64_t row, const float* bias, float* y, int64_t n) {
  blocks::for_tiles<kTile>(m, [&](auto size, int64_t j0) {
    tile<W, R, decltype(size)::value>(w, x, k, j0, row, bias, y, n);
  });
}

#if defined(TGI_AMX)
// Several x rows on AMX tiles (W::kAmxRows on; tile()'s fp32 steps per pair, vectorized):
// tiles 0-3 take 4 chunks' int32 sums at a time (16 weight rows x up to 16 x rows), 4 and 5
// weight chunks (16 rows x 32 signed bytes), 6 and 7 x chunks (8 groups of 4 bytes x the x rows);
// TDPBSSD's sum of a chunk is the lanes' sum of tile(), exactly. A block's 16 weight rows are
// decoded to int8 once (Int8Rows: read in place), then multiplied with every group of 16 x rows.

inline void configure_tiles(int64_t lanes) {
  const int64_t sums = lanes * 4, x_rows = kChunk / 4;
  amx::load_config({16, 16, 16, 16, 16, 16, x_rows, x_rows}, {sums, sums, sums, sums, kChunk, kChunk, sums, sums});
}

// Chunk t of 4 (weights `a`, `stride` bytes between rows; x words `b`) into sums tile t, from 0.
// The tile intrinsics take tile numbers as literals: one branch per tile.
template <int t>
inline void chunk_tile(const int8_t* a, int64_t stride, const uint32_t* b, int64_t b_stride) {
  if constexpr (t == 0) {
    _tile_zero(0);
    _tile_loadd(4, a, stride);
    _tile_loadd(6, b, b_stride);
    _tile_dpbssd(0, 4, 6);
  } else if constexpr (t == 1) {
    _tile_zero(1);
    _tile_loadd(5, a, stride);
    _tile_loadd(7, b, b_stride);
    _tile_dpbssd(1, 5, 7);
  } else if constexpr (t == 2) {
    _tile_zero(2);
    _tile_loadd(4, a, stride);
    _tile_loadd(6, b, b_stride);
    _tile_dpbssd(2, 4, 6);
  } else {
    _tile_zero(3);
    _tile_loadd(5, a, stride);
    _tile_loadd(7, b, b_stride);
    _tile_dpbssd(3, 5, 7);
  }
}

// y for weight rows row0 .. row0 + 16 (`rows` of them) and the x rows of one group, from L lanes per
// weight row (L >= the group's x rows: 16 / L weight rows per vector, L vectors): lane l of vector
// q holds weight row q * 16 / L + l / L against x row l % L.
template <int L>
void amx_group(const int8_t* a, int64_t k, const uint32_t* group, const float* scales, const float* block_scales,
               int64_t per_block, int64_t row0, int64_t rows, int64_t valid, float w_scale, const float* bias,
               float* y, int64_t n) {
  constexpr int kRowsPer = 16 / L;
  const int64_t chunks = k / kChunk, stride = L * 4;  // tile rows stored L int32 apart: L vectors per chunk
  // [batch][chunk t][16 * L]: the tiles of 4 chunks are stored while the fp32 steps run on the 4
  // before them (a vector load of a tile store still in flight waits for it)
  alignas(64) int32_t sums[2][4][16 * L];
  __m512 acc[L], part[L];
  for (int q = 0; q < L; ++q) acc[q] = part[q] = _mm512_setzero_ps();
  __m512i spread[L];  // vector q takes row q * kRowsPer + l / L of a [16] array
  for (int q = 0; q < L; ++q)
    spread[q] = _mm512_add_epi32(_mm512_set1_epi32(q * kRowsPer),
                                 _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                   __builtin_ctz(L)));
  auto steps = [&](int64_t c0, const int32_t (&batch)[4][16 * L]) {
    for (int64_t c = c0; c < std::min(chunks, c0 + 4); ++c) {
      const __m512 scale = _mm512_load_ps(scales + c * 16);
      for (int q = 0; q < L; ++q)
        part[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(batch[c - c0] + 16 * q)), scale, part[q]);
      if ((c + 1) % per_block == 0) {
        const __m512 ws = _mm512_load_ps(block_scales + c / per_block * 16);  // the 16 rows' scales
        for (int q = 0; q < L; ++q) {
          acc[q] = _mm512_fmadd_ps(part[q], _mm512_permutexvar_ps(spread[q], ws), acc[q]);
          part[q] = _mm512_setzero_ps();
        }
      }
    }
  };
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    const int64_t count = std::min<int64_t>(4, chunks - c0);
    auto& batch = sums[(c0 / 4) & 1];
    const uint32_t* b = group + c0 * 8 * L;
    chunk_tile<0>(a + c0 * kChunk, k, b, stride);
    if (count > 1) chunk_tile<1>(a + (c0 + 1) * kChunk, k, b + 8 * L, stride);
    if (count > 2) chunk_tile<2>(a + (c0 + 2) * kChunk, k, b + 16 * L, stride);
    if (count > 3) chunk_tile<3>(a + (c0 + 3) * kChunk, k, b + 24 * L, stride);
    _tile_stored(0, batch[0], stride);
    if (count > 1) _tile_stored(1, batch[1], stride);
    if (count > 2) _tile_stored(2, batch[2], stride);
    if (count > 3) _tile_stored(3, batch[3], stride);
    if (c0 > 0) steps(c0 - 4, sums[(c0 / 4 - 1) & 1]);
  }
  steps((chunks - 1) / 4 * 4, sums[((chunks - 1) / 4) & 1]);
  alignas(64) float out[16 * L];  // [weight row i][x row j]
  for (int q = 0; q < L; ++q) _mm512_store_ps(out + 16 * q, acc[q]);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 biases = bias ? _mm512_maskz_loadu_ps(mask, bias + row0) : _mm512_setzero_ps();
  const __m512i apart = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(L));
  for (int64_t j = 0; j < valid; ++j) {
    const __m512 value = _mm512_mul_ps(_mm512_i32gather_ps(apart, out + j, 4), _mm512_set1_ps(w_scale));
    _mm512_mask_storeu_ps(y + j * n + row0, mask, bias ? _mm512_add_ps(value, biases) : value);
  }
}

template <class W>
void amx_product(const W& w, const X& x, const float* bias, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t chunks = k / kChunk, width = std::min<int64_t>(m, 16), groups = (m + width - 1) / width;
  const int lanes = width <= 2 ? 2 : width <= 4 ? 4 : width <= 8 ? 8 : 16;  // L (m >= 2 here)
  const int64_t per_block = (int64_t{1} << w.shift()) / kChunk, blocks = chunks / per_block;
  // x as B tiles of L columns: word ((g * chunks + c) * 8 + p) * L + j = bytes 4p .. 4p + 3 of
  // chunk c of x row g * width + j; its scales as [g][c][16], lane l the scale of x row l % L
  // (zero beyond m)
  simd::Buffer<uint32_t> words(groups * chunks * 8 * lanes, 0);
  simd::Buffer<float> scales(groups * chunks * 16, 0.0f);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t g = j / width, column = j % width;
      const auto* row = reinterpret_cast<const uint32_t*>(x.chunks.data() + 2 * j * k);
      for (int64_t c = 0; c < chunks; ++c) {
        uint32_t* out = words.data() + (g * chunks + c) * 8 * lanes + column;
        for (int64_t p = 0; p < 8; ++p) out[p * lanes] = row[c * 16 + p];  // 16 words a chunk: values, lane starts
        for (int64_t l = column; l < 16; l += lanes) scales[(g * chunks + c) * 16 + l] = x.scales[j * chunks + c];
      }
    }
  });
  const int shift = w.shift();
  at::parallel_for(0, (n + 15) / 16, std::max<int64_t>(1, 4096 / k), [&](int64_t b0, int64_t b1) {
    configure_tiles(lanes);
    simd::Buffer<int8_t> decoded(16 * k);
    simd::Buffer<float> block_scales(blocks * 16);  // [block of k][weight row]: 0 for missing rows
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t row0 = b * 16, rows = std::min<int64_t>(16, n - row0);
      const int8_t* a = w.rows_for_tiles(row0, rows, decoded.data());
      for (int64_t i = 0; i < 16; ++i) {
        const float* own = i < rows ? w.block_scales() + ((row0 + i) * k >> shift) : nullptr;
        float* to = block_scales.data() + i;
        for (int64_t q = 0; q < blocks; ++q) to[q * 16] = own ? own[q] : 0.0f;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const uint32_t* group = words.data() + g * chunks * 8 * lanes;
        const float* group_scales = scales.data() + g * chunks * 16;
        float* y_group = y + g * width * n;
        const int64_t valid = std::min(width, m - g * width);
        auto run = [&](auto size) {
          amx_group<decltype(size)::value>(a, k, group, group_scales, block_scales.data(), per_block, row0, rows,
                                           valid, w.scale, bias, y_group, n);
        };
        switch (lanes) {
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 4: run(std::integral_constant<int, 4>{}); break;
          case 8: run(std::integral_constant<int, 8>{}); break;
          default: run(std::integral_constant<int, 16>{}); break;
        }
      }
    }
    _tile_release();
  });
}
#endif

template <class W>
void product(const W& w, const float* xf, const float* bias, float* y, int64_t m, int64_t k, int64_t n) {
  const X x = quantize(xf, m, k, W::kReordered);
  const int64_t blocksize = int64_t{1} << w.shift();
  const bool aligned = k % blocksize == 0;
#if defined(TGI_AMX)
  static_assert(W::kAmxRows >= 2, "amx_product's lanes start at 2 x rows");
  if (m >= W::kAmxRows && aligned && amx::permitted()) {
    amx_product(w, x, bias, y, m, k, n);
    return;
  }
#endif
  // Several weight rows at a time (independent sums in flight) where their blocks line up: 4 for
  // one x row (int8 rows took pairs before: the 0.5B's head 12.3 ms against 7.1 on an AMX Xeon;
  // with VNNI two chunks an instruction, tile_pairs: a 0.5B nf4 step 0.92x the time), else pairs,
  // each against tiles of 2 x rows. The 0.5B's layers (2 threads, a Zen 3,
  // with each lane converted alone then): 0.49x the time of the fp32 4-bit products at one x row,
  // 0.53-0.57 / 0.76-0.81 / 0.81-0.88x at 2 / 4 / 16 rows; x tiles in L1 against spans of weight
  // rows in L2 gained nothing measurable.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const bool pairs = aligned && m == 1 && blocksize >= 2 * kChunk;  // each block an even number of chunks
#endif
  const int64_t grain = std::max<int64_t>(1, 16384 / k);
  at::parallel_for(0, (n + 3) / 4, grain, [&](int64_t b0, int64_t b1) {
    const int64_t end = std::min(n, b1 * 4);
    int64_t row = b0 * 4;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (pairs)
      for (; row + 4 <= end; row += 4) tile_pairs(w, x, k, row, bias, y, n);
#endif
    if (aligned && m == 1)
      for (; row + 4 <= end; row += 4) tile<W, 4, 1>(w, x, k, 0, row, bias, y, n);
    if (aligned)
      for (; row + 2 <= end; row += 2) rows<W, 2>(w, x, m, k, row, bias, y, n);
    for (; row < end; ++row) rows<W, 1>(w, x, m, k, row, bias, y, n);
  });
}

}  // namespace q8

// ---- LLM.int8() -------------------------------------------------------------------------------
constexpr int64_t kBytes = static_cast<int64_t>(sizeof(I));  // int8 values per chunk

// x quantized as bitsandbytes does (see the header), in the layout the dot product wants.
struct QuantizedX {
  int64_t padded_k;
  simd::Buffer<uint8_t> unsigned_part;  // |x| (or x + 128 for VNNI)
  simd::Buffer<int8_t> signs;           // x itself (its sign moves onto w)
  std::vector<float> scales;           // absmax of each row's fp16 values below the threshold
  std::vector<int64_t> outliers;       // the columns that are outliers in some row
  std::vector<char> own;               // [m, k]: whether column c is an outlier of row j
  std::vector<int64_t> counts;         // each row's own outlier columns
};

inline float to_fp16_and_back(float value) { return _cvtsh_ss(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT)); }

inline F to_fp16_and_back(F value) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
#else
  return _mm256_cvtph_ps(_mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
#endif
}

// |v| with the lanes at or above `limit` zeroed, and those lanes as bits (NaN is neither).
inline F below(F v, F limit, uint32_t& above) {
#if defined(__AVX512F__)
  const F magnitude = _mm512_abs_ps(v);
  const __mmask16 mask = _mm512_cmp_ps_mask(magnitude, limit, _CMP_GE_OQ);
  above = mask;
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~mask), magnitude);
#else
  const F magnitude = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  const F mask = _mm256_cmp_ps(magnitude, limit, _CMP_GE_OQ);
  above = static_cast<uint32_t>(_mm256_movemask_ps(mask));
  return _mm256_andnot_ps(mask, magnitude);
#endif
}

inline float hmax(F v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#else
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
}

// kLanes values rounded to integers as std::nearbyint rounds them (the default mode: to nearest,
// ties to even), stored as int8 at `out` (saturated: the values quantized here lie within
// +-127; an outlier column's may not, and is zeroed afterwards).
inline void store_int8(F value, int8_t* out) {
#if defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(value)));
#else
  const __m256i words = _mm256_cvtps_epi32(value);
  const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(halves, halves));
#endif
}

// x + 128 (VNNI) or |x| (maddubs) of kBytes int8 values.
inline void store_unsigned(const int8_t* x, uint8_t* out) {
#if defined(__AVX512VNNI__)
  _mm512_storeu_si512(out, _mm512_xor_si512(simd::load_i(x), _mm512_set1_epi8(static_cast<char>(0x80))));
#elif defined(__AVX512F__)
  _mm512_storeu_si512(out, _mm512_abs_epi8(simd::load_i(x)));
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_abs_epi8(simd::load_i(x)));
#endif
}

// Rows in parallel (a prefill's thousand rows of k = 4864 took 32 ms on one thread, more than
// the products of that projection): first the fp16 values, each row's scale and its outlier
// columns (its own, see the header), then the quantized rows, in vectors (scalar loops here cost
// 90 us for 8 rows of k = 4864, a third of that projection's weight stream). `unsigned_too`: the
// layout of the AVX dot products as well (AMX's tiles read the signed values alone).
QuantizedX quantize_rows(const float* x, int64_t m, int64_t k, float threshold, bool unsigned_too) {
  QuantizedX q{blocks::round_up(k, kBytes), {}, {}, std::vector<float>(m, 0.0f), {},
               std::vector<char>(m * k, 0), std::vector<int64_t>(m, 0)};
  std::vector<float> half(m * k);
  // compared in fp16, as torch compares an fp16 tensor; no threshold: NaN, which no |x| reaches (inf neither)
  const float limit = threshold > 0.0f ? to_fp16_and_back(threshold) : std::numeric_limits<float>::quiet_NaN();
  const F limits = simd::set1(limit);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k));
  const int64_t whole = k / simd::kLanes * simd::kLanes;
  at::parallel_for(0, m, grain, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* row = x + j * k;
      char* mine = q.own.data() + j * k;
      float* h = half.data() + j * k;
      F scale = simd::zero();
      for (int64_t c = 0; c < whole; c += simd::kLanes) {
        const F value = to_fp16_and_back(simd::load(row + c));
        simd::store(h + c, value);
        uint32_t above;
        scale = simd::max_(below(value, limits, above), scale);  // a NaN magnitude leaves the scale
        for (; above; above &= above - 1) mine[c + __builtin_ctz(above)] = 1;
      }
      float tail = 0.0f;
      for (int64_t c = whole; c < k; ++c) {
        h[c] = to_fp16_and_back(row[c]);
        const float magnitude = std::fabs(h[c]);
        if (magnitude >= limit) {
          mine[c] = 1;
        } else {
          tail = std::max(tail, magnitude);
        }
      }
      q.scales[j] = std::max(hmax(scale), tail);
      q.counts[j] = std::count(mine, mine + k, 1);
    }
  });
  if (std::any_of(q.counts.begin(), q.counts.end(), [](int64_t count) { return count > 0; })) {
    std::vector<char> any(k, 0);
    for (int64_t j = 0; j < m; ++j)
      if (q.counts[j])
        for (int64_t c = 0; c < k; ++c) any[c] |= q.own[j * k + c];
    for (int64_t c = 0; c < k; ++c)
      if (any[c]) q.outliers.push_back(c);
  }
  q.signs.assign(m * q.padded_k, 0);
  if (unsigned_too) q.unsigned_part.assign(m * q.padded_k, 0);
  at::parallel_for(0, m, grain, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      int8_t* signs = q.signs.data() + j * q.padded_k;
      if (q.scales[j] != 0.0f) {  // else every value is 0
        // torch's `127.0 / row_stats` is `row_stats.reciprocal() * 127.0`: two roundings.
        const float factor = (1.0f / q.scales[j]) * 127.0f;
        const float* h = half.data() + j * k;
        const F factors = simd::set1(factor);
        for (int64_t c = 0; c < whole; c += simd::kLanes) store_int8(simd::mul(simd::load(h + c), factors), signs + c);
        for (int64_t c = whole; c < k; ++c) signs[c] = static_cast<int8_t>(std::nearbyint(h[c] * factor));
        if (q.counts[j])
          for (const int64_t c : q.outliers) signs[c] = q.own[j * k + c] ? 0 : signs[c];
      }
      if (unsigned_too) {  // the padding too: x = 0 there
        uint8_t* unsigned_part = q.unsigned_part.data() + j * q.padded_k;
        for (int64_t c = 0; c < q.padded_k; c += kBytes) store_unsigned(signs + c, unsigned_part + c);
      }
    }
  });
  return q;
}

// One chunk of a quantized x row, as the dot product reads it.
struct XChunk {
  I u;  // |x| (x + 128 for VNNI)
  I s;  // x (its sign moves onto w; unused by VNNI)
};

inline XChunk load_x(const QuantizedX& q, int64_t j, int64_t c) {
  const int64_t at = j * q.padded_k + c;
#if defined(__AVX512VNNI__)
  return {simd::load_i(q.unsigned_part.data() + at), simd::zero_i()};
#else
  return {simd::load_i(q.unsigned_part.data() + at), simd::load_i(q.signs.data() + at)};
#endif
}

inline I dot_i8(I acc, I w, const XChunk& x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, x.u, w);
#elif defined(__AVX512F__)
  const __mmask64 negative = _mm512_movepi8_mask(x.s);
  const I signed_w = _mm512_mask_sub_epi8(w, negative, _mm512_setzero_si512(), w);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(x.u, signed_w), _mm512_set1_epi16(1)));
#else
  const I signed_w = _mm256_sign_epi8(w, x.s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x.u, signed_w), _mm256_set1_epi16(1)));
#endif
}

// x rows per tile: each weight chunk is loaded once for MT rows (32 vector registers hold 4 x 4
// sums, 16 hold 4 x 2).
#if defined(__AVX512F__)
constexpr int kInt8Tile = 4;
#else
constexpr int kInt8Tile = 2;
#endif

// Exact int32 sums of x rows j0 .. j0 + MT against weight rows row .. row + R over the padded k.
template <int R, int MT>
void int8_sums(const Int8Weight& w, int64_t k, const QuantizedX& q, int64_t j0, int64_t row, int32_t (&sums)[R][MT]) {
  I acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = simd::zero_i();
  auto step = [&](int64_t c, bool tail) {
    I wv[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* codes = w.codes + (row + r) * k + c;
      if (tail) {  // the last partial chunk, zero-padded
        alignas(64) int8_t part[kBytes] = {};
        std::memcpy(part, codes, k - c);
        wv[r] = simd::load_i(part);
      } else {
        wv[r] = simd::load_i(codes);
      }
      if (j0 == 0) simd::prefetch_ahead(codes);
    }
    for (int j = 0; j < MT; ++j) {
      const XChunk x = load_x(q, j0 + j, c);
      for (int r = 0; r < R; ++r) acc[r][j] = dot_i8(acc[r][j], wv[r], x);
    }
  };
  const int64_t whole = k / kBytes * kBytes;
  for (int64_t c = 0; c < whole; c += kBytes) step(c, false);
  if (whole < k) step(whole, true);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) {
      sums[r][j] = simd::hsum_i32(acc[r][j]);
#if defined(__AVX512VNNI__)
      sums[r][j] -= 128 * w.row_sums[row + r];  // the padding adds nothing: its w is 0
#endif
    }
}

}  // namespace

void linear_4bit(const float* x, const Packed4& w, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
                 bool round_bf16, bool int8_x) {
  if (int8_x) {
    q8::product(q8::FourBitRows(w, k), x, bias, y, m, k, n);
    return;
  }
  const FourBit weights{w, Decoder(w.table), __builtin_ctzll(w.blocksize), k};
  const Prepared<float> prepared = prepare_4bit(x, m, k);
  if (!round_bf16) {
    four_bit<false>(weights, prepared, m, bias, y, n);
    return;
  }
#if defined(TGI_AMX)
  // Every row count on the tiles, one x row too, although it decodes faster to fp32 lanes
  // (0.5B-shaped layers: 2.9 ms against 3.6-3.8 on the tiles; 8 rows 8.2 against 4.8-5.0): the
  // tiles sum in another order than the lanes, and a row's result must not depend on how many
  // rows share its product (a verification must equal its one-token steps).
  if (amx::permitted()) {
    four_bit_tiles(weights, narrow_prepared(prepared, m, k), m, bias, y, n);
  } else {
    four_bit<true>(weights, prepared, m, bias, y, n);
  }
#elif defined(__AVX512BF16__)
  four_bit<true>(weights, narrow_prepared(prepared, m, k), m, bias, y, n);
#else
  four_bit<true>(weights, prepared, m, bias, y, n);
#endif
}

void linear_int8_weights_int8_x(const float* x, const int8_t* w, const float* scales, int64_t blocksize,
                                const float* bias, float* y, int64_t m, int64_t k, int64_t n) {
  q8::product(q8::Int8Rows{w, scales, k, blocksize}, x, bias, y, m, k, n);
}

// y = the int part dequantized (+ bias), then the outlier columns (see the header). For bf16
// activations (given here widened to fp32, exactly) bitsandbytes rounds the int part and the
// dequantized outlier weights to bf16 before its bf16 addmm; the caller rounds the sum.
void linear_int8(const float* x, const Int8Weight& w, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
                 float threshold, bool round_bf16) {
  const float to_float = static_cast<float>(6.200124e-05);  // bitsandbytes' 1 / 127^2 (a double, used as fp32)
  const float to_weight = static_cast<float>(7.874015718698502e-3);  // its 1 / 127
#if defined(TGI_AMX)
  // Below 5 x rows the VNNI dot products stream the weights faster than the tiles (0.5B-shaped
  // layers, 1 / 4 / 5 / 8 rows: tiles 3.98 / 3.09 / 3.15 / 3.44 ms, VNNI 3.74 / 2.79 / 3.47 / 4.16);
  // the sums are the same exact integers either way.
  const bool on_tiles = m >= 5 && amx::permitted();
#else
  constexpr bool on_tiles = false;
#endif
  const QuantizedX q = quantize_rows(x, m, k, threshold, !on_tiles);
  const int64_t outliers = static_cast<int64_t>(q.outliers.size());
  // x's outlier columns, [outlier][row] (rows padded to whole vectors; 0 where the column is not
  // an outlier of that row: an exact zero term leaves a sum as it was): the outlier sums run over
  // x rows in vector lanes, for R weight rows at once, each row's sum over the columns in their
  // order (mul then add, as the scalar loop compiled without contraction). A batch of 8 rows of
  // the 0.5B has ~15 outlier columns per projection, a prefill of 1024 tokens 100 and more: summed
  // one x row at a time those cost 3-4x the int8 products.
  const int64_t padded_m = blocks::round_up(m, simd::kLanes);
  simd::Buffer<float> x_outliers(outliers * padded_m, 0.0f);
  for (int64_t j = 0; j < m; ++j)
    for (int64_t o = 0; o < outliers; ++o)
      if (q.own[j * k + q.outliers[o]]) x_outliers[o * padded_m + j] = x[j * k + q.outliers[o]];
  // extra[r * padded_m + j]: weight row row + r's outlier sum for x row j.
  auto outlier_sums = [&]<int R>(int64_t row, float* weights, float* extra) {
    for (int r = 0; r < R; ++r)
      for (int64_t o = 0; o < outliers; ++o) {
        float& value = weights[r * outliers + o];
        value = static_cast<float>(w.codes[(row + r) * k + q.outliers[o]]) * w.scales[row + r] * to_weight;
        if (round_bf16) value = simd::from_bf16(simd::to_bf16(value));
      }
    for (int64_t j = 0; j < padded_m; j += simd::kLanes) {
      F acc[R];
      for (auto& a : acc) a = simd::zero();
      for (int64_t o = 0; o < outliers; ++o) {
        const F xo = simd::load(x_outliers.data() + o * padded_m + j);
        for (int r = 0; r < R; ++r) acc[r] = simd::add(acc[r], simd::mul(xo, simd::set1(weights[r * outliers + o])));
      }
      for (int r = 0; r < R; ++r) simd::store(extra + r * padded_m + j, acc[r]);
    }
  };
  auto finish = [&](int64_t j, int64_t r, int32_t sum, float extra) {  // extra: x row j's outlier sum, row r
    float value = static_cast<float>(sum) * (q.scales[j] * w.scales[r]) * to_float;
    if (bias) value += bias[r];
    if (q.counts[j]) {
      if (round_bf16) value = simd::from_bf16(simd::to_bf16(value));
      value += extra;
    }
    y[j * n + r] = value;
  };
  // Weight rows row .. row + R against x rows j0 .. j0 + MT, into block_sums [R][m].
  auto tile = [&]<int R, int MT>(int64_t row, int64_t j0, int32_t* block_sums) {
    int32_t sums[R][MT];
    int8_sums<R, MT>(w, k, q, j0, row, sums);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < MT; ++j) block_sums[r * m + j0 + j] = sums[r][j];
  };
  // Weight rows row .. row + R against every x row; the outlier weights are gathered after the
  // products, while those rows are in the cache.
  auto all_x = [&]<int R>(int64_t row, int32_t* block_sums, float* weights, float* extra) {
    blocks::for_tiles<kInt8Tile>(m, [&](auto size, int64_t j0) {
      tile.template operator()<R, decltype(size)::value>(row, j0, block_sums);
    });
    if (outliers) outlier_sums.template operator()<R>(row, weights, extra);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < m; ++j)
        finish(j, row + r, block_sums[r * m + j], outliers ? extra[r * padded_m + j] : 0.0f);
  };
#if defined(TGI_AMX)
  if (on_tiles) {  // the same sums from the tiles, each weight row finished while in the cache
    amx::int8_rows(w.codes, k, n, q.signs.data(), m, q.padded_k, [&] {
      return [&, weights = std::vector<float>(outliers), extra = simd::Buffer<float>(outliers ? padded_m : 0)](
                 int64_t row, const int32_t* sums) mutable {
        if (outliers) outlier_sums.template operator()<1>(row, weights.data(), extra.data());
        for (int64_t j = 0; j < m; ++j) finish(j, row, sums[j], outliers ? extra[j] : 0.0f);
      };
    });
    return;
  }
#endif
  const int64_t blocks = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 4 * k));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> block_sums(4 * m);
    std::vector<float> weights(4 * outliers);
    simd::Buffer<float> extra(outliers ? 4 * padded_m : 0);
    const int64_t end = std::min(n, b1 * 4);
    int64_t row = b0 * 4;
    for (; row + 4 <= end; row += 4) all_x.template operator()<4>(row, block_sums.data(), weights.data(), extra.data());
    for (; row < end; ++row) all_x.template operator()<1>(row, block_sums.data(), weights.data(), extra.data());
  });
}

}  // namespace tgi
