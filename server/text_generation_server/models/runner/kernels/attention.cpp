// Attention of a few new queries per row against the cache, in place of SDPA.
//
// Design note: decode steps and draft verification bring 1..16 new tokens per row whose keys
// and values were just written into the cache; each new query attends to every cache column
// its mask row allows (the runner's additive mask encodes the causal order among the new
// tokens, left padding and sliding windows), so the result is exact causal attention over
// cache + new tokens. SDPA's CPU flash kernel costs ~50 us per call at these sizes; this is
// one pass per (row, new token, head) on whole vectors: fp32 scores, a max-subtracted softmax and
// fp32 sums, as SDPA's CPU kernel accumulates. Masked entries hold the dtype's minimum, never
// -inf, so a padding query (which sees no key) gets a uniform softmax instead of NaNs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace tgi {
namespace {

inline float as_float(float value) { return value; }
inline float as_float(uint16_t value) { return simd::from_bf16(value); }
inline simd::F load(const float* p) { return simd::load(p); }
inline simd::F load(const uint16_t* p) { return simd::load_bf16(p); }
inline void store(float* out, float value) { *out = value; }
inline void store(uint16_t* out, float value) { *out = simd::to_bf16(value); }

// query . key over dim values: whole vectors, then the tail.
template <typename T>
inline float dot(const float* query, const T* key, int64_t dim) {
  simd::F acc = simd::zero();
  int64_t i = 0;
  for (; i + simd::kLanes <= dim; i += simd::kLanes) acc = simd::fmadd(simd::load(query + i), load(key + i), acc);
  float sum = simd::hsum(acc);
  for (; i < dim; ++i) sum += query[i] * as_float(key[i]);
  return sum;
}

// One query row `query` [dim] (fp32) against `total` keys/values of one kv head; the exponentials
// and both products run on whole vectors (a scalar exp per cache column cost ~10 us per layer at
// 64 columns, as much as the layer's smaller products).
template <typename T>
void one_query(const float* query, const T* kr, const T* vr, const T* mask_row, const AttentionShape& s, float scale,
               simd::Buffer<float>& scores, simd::Buffer<float>& acc, T* out) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < s.total; ++t) {
    scores[t] = dot(query, kr + t * s.k_column, s.dim) * scale + as_float(mask_row[t]);
    best = std::max(best, scores[t]);
  }
  const simd::F top = simd::set1(best);
  simd::F sums = simd::zero();
  int64_t t = 0;
  for (; t + simd::kLanes <= s.total; t += simd::kLanes) {
    const simd::F e = simd::exp(simd::sub(simd::load(scores.data() + t), top));
    simd::store(scores.data() + t, e);
    sums = simd::add(sums, e);
  }
  float sum = simd::hsum(sums);
  for (; t < s.total; ++t) {
    scores[t] = std::exp(scores[t] - best);
    sum += scores[t];
  }
  std::fill(acc.begin(), acc.end(), 0.0f);
  const int64_t whole = s.dim / simd::kLanes * simd::kLanes;
  for (int64_t u = 0; u < s.total; ++u) {
    const T* vt = vr + u * s.v_column;
    const simd::F p = simd::set1(scores[u]);
    for (int64_t i = 0; i < whole; i += simd::kLanes)
      simd::store(acc.data() + i, simd::fmadd(p, load(vt + i), simd::load(acc.data() + i)));
    for (int64_t i = whole; i < s.dim; ++i) acc[i] += scores[u] * as_float(vt[i]);
  }
  for (int64_t i = 0; i < s.dim; ++i) store(out + i, acc[i] / sum);
}

}  // namespace

template <typename T>
void attention(const T* q, const T* keys, const T* values, const T* mask, T* out, const AttentionShape& s,
               float scale) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t tasks = s.rows * s.new_tokens * s.heads;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, s.total * s.dim));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    simd::Buffer<float> scores(s.total), query(s.dim), acc(s.dim);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task % s.heads, token = (task / s.heads) % s.new_tokens, r = task / (s.heads * s.new_tokens);
      const T* qr = q + r * s.q_row + token * s.q_token + h * s.q_head;
      for (int64_t i = 0; i < s.dim; ++i) query[i] = as_float(qr[i]);
      const int64_t g = h / group;
      const T* mask_row = mask + (r * s.new_tokens + token) * s.total;
      T* o = out + ((r * s.new_tokens + token) * s.heads + h) * s.dim;
      one_query(query.data(), keys + r * s.k_row + g * s.k_head, values + r * s.v_row + g * s.v_head, mask_row, s,
                scale, scores, acc, o);
    }
  });
}

template void attention<float>(const float*, const float*, const float*, const float*, float*, const AttentionShape&,
                               float);
template void attention<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                                  const AttentionShape&, float);

}  // namespace tgi
