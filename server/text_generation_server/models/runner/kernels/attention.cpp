// Attention of a few new queries per row against the cache, in place of SDPA.
//
// Design note: decode steps and draft verification bring 1..16 new tokens per row whose keys
// and values were just written into the cache; each new query attends to every cache column
// its mask row allows (the runner's additive mask encodes the causal order among the new
// tokens, left padding and sliding windows), so the result is exact causal attention over
// cache + new tokens. SDPA's CPU flash kernel costs ~50 us per call at these sizes.
//
// A task is one row's kv head and a block of the queries that share it (the group's heads times
// the new tokens): each key and value column is read from memory once per block, and the block's
// dot products and accumulations are independent of one another, so they overlap instead of
// waiting on one accumulator. One query at a time, a column cost ~50 cycles (a chain of dependent
// FMAs, a horizontal sum, accumulators through memory): 4 rows x 4 new tokens of the 0.5B at 1250
// cached tokens took 1.7-2.1 ms per layer (now 0.8), 42-49 ms of a 4-row verification. Each
// query's arithmetic does not depend on its block (fp32 scores, a max-subtracted softmax and fp32
// sums, as SDPA's CPU kernel accumulates; values accumulated column by column), so a query's
// result is the same whatever else the forward carries; and its sums run over the columns in
// order, where a masked column adds exactly 0, so it is also the same wherever masked columns lie
// (left padding, a rejected draft's columns, the queries after it in a verification): a k-token
// verification computes what k one-token steps compute, bit for bit, in any batch (see
// softmax_numerators and accumulate_queries). Masked entries hold the dtype's minimum,
// never -inf, so a padding query (which sees no key) gets a uniform softmax instead of NaNs.
// A paged cache is read in place: column t of a row is wherever its slot id says
// (AttentionShape::slots), the same values in the same order, so the result is the same bits.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace tgi {
namespace {

constexpr int64_t kMaxBlock = 8;  // queries per task: their scores stay in L1
// Queries whose value sums share registers: two on AVX-512 (32 registers: 2 x 8 sums and 8 values),
// one on AVX2 (16 registers: 8 sums).
constexpr int kQueries = simd::kLanes == 16 ? 2 : 1;

inline float as_float(float value) { return value; }
inline float as_float(uint16_t value) { return simd::from_bf16(value); }
inline simd::F load(const float* p) { return simd::load(p); }
inline simd::F load(const uint16_t* p) { return simd::load_bf16(p); }
inline void store(float* out, float value) { *out = value; }
inline void store(uint16_t* out, float value) { *out = simd::to_bf16(value); }

// A cache column as fp32: fp32 columns are read where they are, bf16 keys widened into `scratch`
// once for the whole block.
inline const float* as_fp32(const float* column, int64_t, float*) { return column; }
inline const float* as_fp32(const uint16_t* column, int64_t dim, float* scratch) {
  for (int64_t i = 0; i < dim; ++i) scratch[i] = simd::from_bf16(column[i]);
  return scratch;
}

// Four sums of one vector each: out[c] = the sum of the lanes of v[c].
inline void lane_sums4(const simd::F (&v)[4], float* out) {
#if defined(__AVX512F__)
  __m256 halves[4];
  for (int c = 0; c < 4; ++c)
    halves[c] = _mm256_add_ps(_mm512_castps512_ps256(v[c]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[c]), 1)));
  simd::hsum4(halves, out);
#else
  simd::hsum4(v, out);
#endif
}

// out[c] = query . key[c] for four key columns: four independent sums over the whole vectors of
// dim, reduced together, then the tail. Every column takes this path (a short last group repeats
// a column), so a score never depends on how many columns the call has.
inline void dot4(const float* query, const float* const (&key)[4], int64_t dim, float* out) {
  simd::F sums[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
  int64_t i = 0;
  for (; i + simd::kLanes <= dim; i += simd::kLanes) {
    const simd::F x = simd::load(query + i);
    for (int c = 0; c < 4; ++c) sums[c] = simd::fmadd(x, simd::load(key[c] + i), sums[c]);
  }
  lane_sums4(sums, out);
  for (; i < dim; ++i)
    for (int c = 0; c < 4; ++c) out[c] += query[i] * key[c][i];
}

// scores[t] = scores[t] * scale + mask[t], then e^(score - max) in place. Every column takes the
// vector path (the last, short group through a copy padded with -inf), so a column's numerator
// does not depend on where it lies (a scalar tail computed the last total % kLanes columns
// unfused, with std::exp). Their sum is taken in column order with the values (accumulate_queries).
template <typename T>
void softmax_numerators(float* scores, const T* mask, int64_t total, float scale) {
  const int64_t whole = total / simd::kLanes * simd::kLanes, rest = total - whole;
  alignas(64) float tail[simd::kLanes], tail_mask[simd::kLanes];
  for (int64_t u = 0; u < simd::kLanes; ++u) {
    tail[u] = u < rest ? scores[whole + u] : 0.0f;
    tail_mask[u] = u < rest ? as_float(mask[whole + u]) : -std::numeric_limits<float>::infinity();
  }
  const simd::F factor = simd::set1(scale);
  simd::F top = simd::set1(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < whole; t += simd::kLanes) {
    const simd::F s = simd::fmadd(simd::load(scores + t), factor, load(mask + t));
    simd::store(scores + t, s);
    top = simd::max_(top, s);
  }
  const simd::F last = simd::fmadd(simd::load(tail), factor, simd::load(tail_mask));
  top = simd::max_(top, last);
  alignas(64) float lanes[simd::kLanes];
  simd::store(lanes, top);
  const simd::F shift = simd::set1(*std::max_element(lanes, lanes + simd::kLanes));
  for (int64_t t = 0; t < whole; t += simd::kLanes)
    simd::store(scores + t, simd::exp(simd::sub(simd::load(scores + t), shift)));
  simd::store(tail, simd::exp(simd::sub(last, shift)));
  std::copy(tail, tail + rest, scores + whole);
}

// acc[q][offset .. offset + S vectors] = sum over columns t of weights[q][t] * values[t][...] for
// one query or two (pair), t ascending: S x (1 or 2) sums held in registers across the columns.
// With `sums` (the first slab of the dimension) also sums[q] = the sum of weights[q][t], t
// ascending (every lane adds the same weights). Every sum here runs over the columns in order and
// a masked column adds exactly 0, so a query's output does not depend on how many masked columns
// lie before, between or after its own: left padding, rejected drafts' columns, later queries.
template <int S, int Q, typename T>
void accumulate_queries(const float* weights, const T* vr, const int64_t* slots, int64_t columns,
                        const AttentionShape& s, int64_t offset, float* acc, float* sums_out) {
  simd::F sums[Q][S], total[Q];
  for (int q = 0; q < Q; ++q) {
    total[q] = simd::zero();
    for (int v = 0; v < S; ++v) sums[q][v] = simd::zero();
  }
  for (int64_t t = 0; t < columns; ++t) {
    const T* value = vr + s.v_offset(slots, t) + offset;
    simd::F w[Q];
    for (int q = 0; q < Q; ++q) w[q] = simd::set1(weights[q * columns + t]);
    for (int v = 0; v < S; ++v) {
      const simd::F x = load(value + v * simd::kLanes);
      for (int q = 0; q < Q; ++q) sums[q][v] = simd::fmadd(w[q], x, sums[q][v]);
    }
    if (sums_out != nullptr)
      for (int q = 0; q < Q; ++q) total[q] = simd::add(total[q], w[q]);
  }
  for (int q = 0; q < Q; ++q) {
    for (int v = 0; v < S; ++v) simd::store(acc + q * s.dim + offset + v * simd::kLanes, sums[q][v]);
    if (sums_out != nullptr) {
      alignas(64) float lanes[simd::kLanes];
      simd::store(lanes, total[q]);
      sums_out[q] = lanes[0];
    }
  }
}

template <int S, typename T>
void accumulate(bool pair, const float* weights, const T* vr, const int64_t* slots, int64_t columns,
                const AttentionShape& s, int64_t offset, float* acc, float* sums) {
  if constexpr (kQueries == 2) {
    if (pair) return accumulate_queries<S, 2>(weights, vr, slots, columns, s, offset, acc, sums);
  }
  accumulate_queries<S, 1>(weights, vr, slots, columns, s, offset, acc, sums);
}

struct Block {
  int64_t row, kv_head, first, count;  // queries first .. first + count of the group (token-major)

  // The new token and the head of the block's query j, in a group of `group` heads per kv head.
  int64_t token(int64_t j, int64_t group) const { return (first + j) / group; }
  int64_t head(int64_t j, int64_t group) const { return kv_head * group + (first + j) % group; }
};

template <typename T>
void attend_block(const T* q, const T* keys, const T* values, const T* mask, T* out, const AttentionShape& s,
                  float scale, const Block& b, simd::Buffer<float>& scores, simd::Buffer<float>& queries,
                  simd::Buffer<float>& acc, simd::Buffer<float>& column) {
  const T* kr = keys + b.row * s.k_row + b.kv_head * s.k_head;
  const T* vr = values + b.row * s.v_row + b.kv_head * s.v_head;
  const int64_t* slots = s.row_slots(b.row);
  // A paged row's leading padding (slot 0, the zero block; masked for every query of the row) is
  // not read: each column it skips would add exactly 0 to every sum, so the result is the same
  // bits, and a short row beside a long one costs its own columns only.
  int64_t skip = 0;
  while (slots != nullptr && skip + 1 < s.total && slots[skip] == 0) ++skip;
  if (slots != nullptr) slots += skip;
  const int64_t group = s.heads / s.kv_heads, dim = s.dim, total = s.total - skip;
  for (int64_t j = 0; j < b.count; ++j) {
    const T* qr = q + b.row * s.q_row + b.token(j, group) * s.q_token + b.head(j, group) * s.q_head;
    for (int64_t i = 0; i < dim; ++i) queries[j * dim + i] = as_float(qr[i]);
  }
  for (int64_t t = 0; t < total; t += 4) {
    const float* key[4];
    for (int64_t c = 0; c < 4; ++c)
      key[c] = as_fp32(kr + s.k_offset(slots, std::min(t + c, total - 1)), dim,
                       column.data() + c * dim);
    for (int64_t j = 0; j < b.count; ++j) {
      float out[4];
      dot4(queries.data() + j * dim, key, dim, out);
      std::copy(out, out + std::min<int64_t>(4, total - t), scores.data() + j * total + t);
    }
  }
  for (int64_t j = 0; j < b.count; ++j) {
    const T* mask_row = mask + (b.row * s.new_tokens + b.token(j, group)) * s.total + skip;
    softmax_numerators(scores.data() + j * total, mask_row, total, scale);
  }
  float sums[kMaxBlock];
  // Values: kQueries queries at a time, the dimension in slabs of whole vectors whose sums stay in
  // registers over all columns, then its tail.
  const int64_t whole = dim / simd::kLanes * simd::kLanes;
  for (int64_t j = 0; j < b.count; j += kQueries) {
    const float* weights = scores.data() + j * total;
    float* a = acc.data() + j * dim;
    const bool pair = kQueries == 2 && j + 1 < b.count;
    float* sums_out = sums + j;  // taken with the first slab only
    int64_t i = 0;
    for (; i + 8 * simd::kLanes <= whole; i += 8 * simd::kLanes, sums_out = nullptr)
      accumulate<8>(pair, weights, vr, slots, total, s, i, a, sums_out);
    for (; i + 4 * simd::kLanes <= whole; i += 4 * simd::kLanes, sums_out = nullptr)
      accumulate<4>(pair, weights, vr, slots, total, s, i, a, sums_out);
    for (; i + 2 * simd::kLanes <= whole; i += 2 * simd::kLanes, sums_out = nullptr)
      accumulate<2>(pair, weights, vr, slots, total, s, i, a, sums_out);
    for (; i < whole; i += simd::kLanes, sums_out = nullptr)
      accumulate<1>(pair, weights, vr, slots, total, s, i, a, sums_out);
    for (int64_t q = j; q < std::min(j + kQueries, b.count); ++q) {
      if (whole == 0) {  // dim < kLanes: no slab took the sum
        sums[q] = 0.0f;
        for (int64_t t = 0; t < total; ++t) sums[q] += scores[q * total + t];
      }
      for (int64_t u = whole; u < dim; ++u) {
        float sum = 0.0f;
        for (int64_t t = 0; t < total; ++t)
          sum += scores[q * total + t] * as_float(vr[s.v_offset(slots, t) + u]);
        acc[q * dim + u] = sum;
      }
    }
  }
  for (int64_t j = 0; j < b.count; ++j) {
    T* o = out + ((b.row * s.new_tokens + b.token(j, group)) * s.heads + b.head(j, group)) * dim;
    for (int64_t i = 0; i < dim; ++i) store(o + i, acc[j * dim + i] / sums[j]);
  }
}

}  // namespace

template <typename T>
void attention(const T* q, const T* keys, const T* values, const T* mask, T* out, const AttentionShape& s,
               float scale) {
  const int64_t per_group = s.heads / s.kv_heads * s.new_tokens, groups = s.rows * s.kv_heads;
  // Blocks of at most kMaxBlock queries, and enough of them for two tasks per thread when the
  // groups alone are fewer (one row of a model with 2 or 3 kv heads).
  const int64_t wanted = (2 * at::get_num_threads() + groups - 1) / groups;
  const int64_t blocks = std::min(per_group, std::max((per_group + kMaxBlock - 1) / kMaxBlock, wanted));
  const int64_t size = (per_group + blocks - 1) / blocks;
  at::parallel_for(0, groups * blocks, 1, [&](int64_t t0, int64_t t1) {
    simd::Buffer<float> scores(size * s.total), queries(size * s.dim), acc(size * s.dim), column(4 * s.dim);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t group = task / blocks, first = task % blocks * size;
      const Block b{group / s.kv_heads, group % s.kv_heads, first, std::min(size, per_group - first)};
      if (b.count > 0) attend_block(q, keys, values, mask, out, s, scale, b, scores, queries, acc, column);
    }
  });
}

template void attention<float>(const float*, const float*, const float*, const float*, float*, const AttentionShape&,
                               float);
template void attention<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                                  const AttentionShape&, float);

}  // namespace tgi
