// Python bindings of the CPU kernels: argument checks, allocation, and a whole decoder layer.
//
// This file holds no ISA-specific code: it is compiled once with baseline flags and linked
// into every variant's module with that variant's kernels (kernels/*.cpp, see cpu_kernels.py).
// Every refusal names the bad argument; the runner decides beforehand what the kernels take.
//
// 1. small_m_linear, Projection: products with 1..16 activation rows on the weight-streaming
//    kernels (dense fp32/bf16, bitsandbytes 4-bit and int8); more rows run through the kernels
//    in chunks of at most 16 (quantized weights, and fp32 up to 64 rows) or on torch's GEMM.
// 2. rms_norm, rope, silu_mul: one pass each instead of 4-8 torch ops.
// 3. decode_attention: 1..16 new queries per row against the cache (exact causal attention
//    through the runner's mask), in place of SDPA's ~50 us CPU call.
// 4. decode_layer: a whole Llama-family decoder layer for a few new tokens per row, composed of
//    the above on raw rows (no torch op inside), so decode steps and draft verification cross
//    from Python once per layer.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/kernels.h"

namespace {

using torch::Tensor;

template <typename T>
T* ptr(const Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

void check_float_dtype(const char* op, const Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, op, ": dtype ",
              x.scalar_type(), " is not supported (float32, bfloat16)");
}

c10::optional<Tensor> present(const c10::optional<Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias : c10::nullopt;
}

// ---- projections: a weight in one of the kernels' formats, with its bias -----------------------
// Dense products of up to this many rows run in chunks on the kernels rather than on torch's GEMM.
// fp32: the 0.5B's prefill of 32 / 64 tokens took 0.24 / 0.44 s chunked against 0.43 / 0.65 s on
// the GEMM, 256 tokens 1.79 s against 1.63. bf16 (since its products take pairs of weight rows
// against up to 12 x rows): the 0.5B's 96 layer products of 17 / 24 / 32 / 48 / 64 rows took 49 /
// 64 / 86 / 138 / 187 ms chunked against 76 / 87 / 101 / 132 / 160 ms on oneDNN's bf16 GEMM.
constexpr int64_t kDenseChunkedRows = 64;
constexpr int64_t kDenseChunkedRowsBf16 = 32;

struct Projection {
  enum class Kind { kDense, kFourBit, kInt8, kInt8Weights } kind = Kind::kDense;
  Tensor weight;           // dense [n, k]; 4-bit codes (n * k / 2 bytes); int8 CB [n, k]
  Tensor absmax, table;    // 4-bit: fp32 absmax per block, the 16 code values
  Tensor scales;           // int8: SCB [n] (the absmax of each weight row)
  Tensor row_sums;         // LLM.int8(): int32 [n], the sum of each row's codes
  Tensor bias;             // undefined, or [n] in the compute dtype
  Tensor bias32;           // the bias in fp32 for the kernels
  int64_t n = 0, k = 0, blocksize = 0;
  double threshold = 0.0;  // LLM.int8() outlier threshold (0: none)
  bool int8_x = false;     // 4-bit, int8 blocks: x quantized to int8 per 32 values (TGI_QUANTIZED_ACTIVATIONS=int8)

  static Projection dense(const Tensor& weight, const c10::optional<Tensor>& bias) {
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "Projection.dense: weight must be a contiguous [n, k]");
    check_float_dtype("Projection.dense", weight);
    Projection p;
    p.weight = weight;
    p.n = weight.size(0);
    p.k = weight.size(1);
    p.set_bias(bias);
    return p;
  }

  static Projection four_bit(const Tensor& codes, const Tensor& absmax, const Tensor& table, int64_t blocksize,
                             int64_t n, int64_t k, const c10::optional<Tensor>& bias, bool int8_x) {
    TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.numel() * 2 == n * k,
                "Projection.four_bit: codes must be n * k / 2 contiguous uint8 values, got ", codes.numel(),
                " for [", n, ", ", k, "]");
    TORCH_CHECK(k % 32 == 0, "Projection.four_bit: k = ", k, " must be a multiple of 32");
    TORCH_CHECK(blocksize >= 32 && (blocksize & (blocksize - 1)) == 0,
                "Projection.four_bit: blocksize ", blocksize, " must be a power of two >= 32");
    TORCH_CHECK(absmax.scalar_type() == torch::kFloat && absmax.is_contiguous() &&
                absmax.numel() == (n * k + blocksize - 1) / blocksize,
                "Projection.four_bit: absmax must hold one fp32 value per block of ", blocksize);
    TORCH_CHECK(table.scalar_type() == torch::kFloat && table.numel() == 16 && table.is_contiguous(),
                "Projection.four_bit: table must hold 16 fp32 values");
    Projection p;
    p.kind = Kind::kFourBit;
    p.int8_x = int8_x;
    p.weight = codes;
    p.absmax = absmax;
    p.table = table;
    p.blocksize = blocksize;
    p.n = n;
    p.k = k;
    p.set_bias(bias);
    return p;
  }

  static Projection int8(const Tensor& codes, const Tensor& scales, const c10::optional<Tensor>& bias,
                         double threshold) {
    TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(),
                "Projection.int8: codes (CB) must be a contiguous int8 [n, k]");
    TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.numel() == codes.size(0) && scales.is_contiguous(),
                "Projection.int8: scales (SCB) must hold one fp32 value per row");
    Projection p;
    p.kind = Kind::kInt8;
    p.weight = codes;
    p.scales = scales;
    p.row_sums = codes.sum(1, false, torch::kInt).contiguous();
    p.n = codes.size(0);
    p.k = codes.size(1);
    p.threshold = threshold;
    p.set_bias(bias);
    return p;
  }

  // Weight-only int8 in blocks of `blocksize` along k: w = codes * scales[block] (x is not quantized,
  // unless int8_x).
  static Projection int8_weights(const Tensor& codes, const Tensor& scales, int64_t blocksize,
                                 const c10::optional<Tensor>& bias, bool int8_x) {
    TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous(),
                "Projection.int8_weights: codes must be a contiguous int8 [n, k]");
    TORCH_CHECK(blocksize >= 32 && (blocksize & (blocksize - 1)) == 0 && codes.size(1) % blocksize == 0,
                "Projection.int8_weights: blocksize ", blocksize, " must be a power of two >= 32 dividing k = ",
                codes.size(1));
    TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                scales.numel() * blocksize == codes.numel(),
                "Projection.int8_weights: scales must hold one fp32 value per block of ", blocksize);
    Projection p;
    p.kind = Kind::kInt8Weights;
    p.int8_x = int8_x;
    p.weight = codes;
    p.scales = scales;
    p.blocksize = blocksize;
    p.n = codes.size(0);
    p.k = codes.size(1);
    p.set_bias(bias);
    return p;
  }

  void set_bias(const c10::optional<Tensor>& value) {
    if (!present(value)) return;
    TORCH_CHECK(value->numel() == n, "Projection: bias has ", value->numel(), " values, weight ", n, " rows");
    bias = value->contiguous();
    bias32 = value->to(torch::kFloat).contiguous();
  }

  int64_t nbytes() const {
    int64_t total = 0;
    for (const Tensor* t : {&weight, &absmax, &scales, &row_sums, &bias})
      if (t->defined()) total += t->numel() * t->element_size();
    return total;
  }

  // y [m, n] = x [m, k] @ W^T (+ bias) on raw rows of T (float, or bf16 bits), m <= kMaxRows (any m
  // for LLM.int8()). With bf16 rows the quantized formats compute in fp32 through x32 [m, k] and
  // y32 [m, n]: the same steps as torch's x.to(float) ... y.to(bfloat16).
  template <typename T>
  void apply(const T* x, T* y, int64_t m, float* x32, float* y32) const {
    constexpr bool bf16 = sizeof(T) == 2;
    const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
    if (kind == Kind::kDense) {
      if constexpr (bf16) {
        tgi::linear_bf16(x, ptr<uint16_t>(weight), bp, y, m, k, n);
      } else {
        tgi::linear_f32(x, ptr<float>(weight), bp, y, m, k, n);
      }
      return;
    }
    const float* xf;
    float* yf;
    if constexpr (bf16) {
      tgi::widen_bf16(x, x32, m * k);
      xf = x32;
      yf = y32;
    } else {
      xf = x;
      yf = y;
    }
    if (kind == Kind::kFourBit) {
      const tgi::Packed4 w{ptr<uint8_t>(weight), absmax.data_ptr<float>(), table.data_ptr<float>(), blocksize};
      tgi::linear_4bit(xf, w, bp, yf, m, k, n, bf16, int8_x);
    } else if (kind == Kind::kInt8Weights) {
      (int8_x ? tgi::linear_int8_weights_int8_x : tgi::linear_int8_weights)(xf, ptr<int8_t>(weight),
                                                                             scales.data_ptr<float>(), blocksize, bp,
                                                                             yf, m, k, n);
    } else {
      const tgi::Int8Weight w{ptr<int8_t>(weight), scales.data_ptr<float>(), row_sums.data_ptr<int32_t>()};
      tgi::linear_int8(xf, w, bp, yf, m, k, n, static_cast<float>(threshold), bf16);
    }
    if constexpr (bf16) tgi::narrow_bf16(y32, y, m * n);
  }

  void check_input(const char* op, torch::ScalarType dtype) const {
    TORCH_CHECK(kind != Kind::kDense || weight.scalar_type() == dtype, op, ": x is ", dtype, " but the weight is ",
                weight.scalar_type());
  }

  // x [m, k] -> [m, n]. exact: dense products of any m in chunks on the kernels, never torch's GEMM,
  // so that every row's result is what a one-row product gives (the runner passes it for decode
  // steps and verifications: at most 16 new tokens per row after a cache, in a batch of any size).
  Tensor operator()(const Tensor& x_in, bool exact) const {
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "Projection: x must be [m, ", k, "], got ", x_in.sizes());
    check_float_dtype("Projection", x_in);
    check_input("Projection", x_in.scalar_type());
    const Tensor x = x_in.contiguous();
    const int64_t m = x.size(0);
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    if (!exact && m > tgi::kMaxRows && kind == Kind::kDense && m > (bf16 ? kDenseChunkedRowsBf16 : kDenseChunkedRows))
      return at::linear(x, weight, present(bias));
    // LLM.int8() takes any m. The other formats run m > kMaxRows rows (prefills) in even chunks of
    // at most kMaxRows, each chunk's weights streamed again: 4-bit prefills then cost about what the
    // dense GEMM costs (the 0.5B's 64 / 256 tokens, nf4: 0.36 / 1.57 s against 1.54 / 2.51 s when the
    // weights were dequantized for torch's GEMM first, dense fp32 GEMM 0.44 / 1.26-1.43 s), with the
    // numerics of a decode step.
    const int64_t chunks = kind == Kind::kInt8 ? 1 : (m + tgi::kMaxRows - 1) / tgi::kMaxRows;
    const int64_t size = (m + chunks - 1) / chunks;
    auto y = torch::empty({m, n}, x.options());
    std::vector<float> x32, y32;  // fp32 scratch for the quantized formats' bf16 rows
    if (bf16 && kind != Kind::kDense) {
      x32.resize(size * k);
      y32.resize(size * n);
    }
    for (int64_t j = 0; j < m; j += size) {
      const int64_t rows = std::min(size, m - j);
      bf16 ? apply(ptr<uint16_t>(x) + j * k, ptr<uint16_t>(y) + j * n, rows, x32.data(), y32.data())
           : apply(ptr<float>(x) + j * k, ptr<float>(y) + j * n, rows, nullptr, nullptr);
    }
    return y;
  }
};

// The dense Projection for one product, with this op's own checks (it refuses more than kMaxRows rows).
Tensor small_m_linear(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_m_linear: x and weight must be 2-D");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_m_linear: x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "small_m_linear: x is ", x.scalar_type(), " but weight is ",
              weight.scalar_type());
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(weight.size(1) == k, "small_m_linear: x has ", k, " features, weight ", weight.size(1));
  TORCH_CHECK(m >= 1 && m <= tgi::kMaxRows, "small_m_linear: ", m, " rows; at most ", tgi::kMaxRows);
  check_float_dtype("small_m_linear", x);
  return Projection::dense(weight, bias)(x, false);
}

// ---- elementwise and attention ----------------------------------------------------------------
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x is ", x.scalar_type(), " but weight is ",
              weight.scalar_type());
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d, "rms_norm: x has ", d, " features, weight ", weight.numel());
  check_float_dtype("rms_norm", x);
  auto y = torch::empty_like(x);
  const int64_t rows = d ? x.numel() / d : 0;
  if (x.scalar_type() == torch::kFloat) {
    tgi::rms_norm(ptr<float>(x), ptr<float>(weight), ptr<float>(y), rows, d, static_cast<float>(eps));
  } else {
    tgi::rms_norm(ptr<uint16_t>(x), ptr<uint16_t>(weight), ptr<uint16_t>(y), rows, d, static_cast<float>(eps));
  }
  return y;
}

// x [rows, new, heads, dim] (a view of the fused projection; rows and tokens evenly strided).
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && (x.size(0) == 1 || x.stride(0) == x.size(1) * x.stride(1)),
              "rope: x must be [rows, new, heads, dim] with rows and tokens evenly strided, got ", x.sizes(),
              " strides ", x.strides());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(1) * x.size(3) &&
              sin.numel() == cos.numel(), "rope: cos and sin must be contiguous [rows, new, 1, dim] tensors");
  TORCH_CHECK(x.size(3) % 2 == 0, "rope: head dim ", x.size(3), " is odd");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
              "rope: x, cos and sin must share a dtype");
  check_float_dtype("rope", x);
  auto y = torch::empty(x.sizes(), x.options());
  const int64_t tokens = x.size(0) * x.size(1), heads = x.size(2), dim = x.size(3);
  if (x.scalar_type() == torch::kFloat) {
    tgi::rope(ptr<float>(x), x.stride(1), x.stride(2), ptr<float>(cos), ptr<float>(sin), ptr<float>(y), tokens, heads,
              dim);
  } else {
    tgi::rope(ptr<uint16_t>(x), x.stride(1), x.stride(2), ptr<uint16_t>(cos), ptr<uint16_t>(sin), ptr<uint16_t>(y),
              tokens, heads, dim);
  }
  return y;
}

Tensor silu_mul(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up must be contiguous with an even last dimension, got ", gate_up.sizes());
  check_float_dtype("silu_mul", gate_up);
  auto sizes = gate_up.sizes().vec();
  const int64_t inner = sizes.back() / 2;
  sizes.back() = inner;
  auto y = torch::empty(sizes, gate_up.options());
  const int64_t tokens = inner ? y.numel() / inner : 0;
  if (gate_up.scalar_type() == torch::kFloat) {
    tgi::silu_mul(ptr<float>(gate_up), ptr<float>(y), tokens, inner);
  } else {
    tgi::silu_mul(ptr<uint16_t>(gate_up), ptr<uint16_t>(y), tokens, inner);
  }
  return y;
}

// A paged cache's keys or values: contiguous [blocks, kv_heads, block_size, dim], block_size a
// power of two; slot s is place s % block_size of block s / block_size.
void check_pool(const char* op, const Tensor& pool, const Tensor& other, int64_t kv_heads, at::ScalarType dtype) {
  TORCH_CHECK(pool.dim() == 4 && other.sizes() == pool.sizes() && pool.is_contiguous() && other.is_contiguous() &&
              pool.size(1) == kv_heads && pool.size(2) > 0 && (pool.size(2) & (pool.size(2) - 1)) == 0 &&
              pool.scalar_type() == dtype && other.scalar_type() == dtype,
              op, ": paged keys and values must be contiguous [blocks, ", kv_heads, ", block_size (a power of two), "
              "dim] of ", dtype, ", got ", pool.sizes(), " and ", other.sizes());
}

// Slot ids of a paged cache: a contiguous int64 [rows, total], each within the pool's slots.
void check_slots(const char* op, const Tensor& slots, int64_t rows, int64_t total, const Tensor& pool) {
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == rows && slots.size(1) == total && slots.is_contiguous() &&
              slots.scalar_type() == torch::kLong, op, ": slots must be a contiguous int64 [", rows, ", ", total,
              "], got ", slots.sizes(), " of ", slots.scalar_type());
  const int64_t capacity = pool.size(0) * pool.size(2);
  const int64_t* ids = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * total; ++i)  // a plain loop: a torch reduction costs more than the layer's reads
    TORCH_CHECK(ids[i] >= 0 && ids[i] < capacity, op, ": slot id ", ids[i], " outside the pool's ", capacity,
                " slots");
}

// The attention shape's paged fields for pools [blocks, kv_heads, block_size, dim].
void set_paged(tgi::AttentionShape& s, const Tensor& keys, const Tensor& values, const Tensor& slots) {
  s.k_row = s.v_row = 0;
  s.k_block = keys.stride(0), s.k_head = keys.stride(1), s.k_column = keys.stride(2);
  s.v_block = values.stride(0), s.v_head = values.stride(1), s.v_column = values.stride(2);
  s.slots = slots.data_ptr<int64_t>();
  s.block_shift = 0;
  while ((int64_t{1} << s.block_shift) < keys.size(2)) ++s.block_shift;
}

// q [rows, new, heads, dim] against keys/values [rows, kv_heads, total, dim] (any strides but the
// last), or, with `slots` [rows, total], against a paged cache's keys/values [blocks, kv_heads,
// block_size, dim] whose column t of row r is slot slots[r, t]; mask [rows, 1, new, total]
// additive -> [rows, new, heads * dim].
Tensor decode_attention(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& mask, double scale,
                        const c10::optional<Tensor>& slots) {
  const bool paged = slots.has_value() && slots->defined();
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() &&
              (paged || keys.size(0) == q.size(0)) && keys.size(3) == q.size(3) && q.size(2) % keys.size(1) == 0,
              "decode_attention: q must be [rows, new, heads, dim] with heads a multiple of the kv heads of keys and "
              "values [rows, kv_heads, total, dim] (paged: [blocks, kv_heads, block_size, dim]); got q ", q.sizes(),
              ", keys ", keys.sizes(), ", values ", values.sizes());
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "decode_attention: the last dimension of q, keys and values must be contiguous");
  const int64_t total = paged ? slots->size(1) : keys.size(2);
  if (paged) {
    check_pool("decode_attention", keys, values, keys.size(1), q.scalar_type());
    check_slots("decode_attention", *slots, q.size(0), total, keys);
  }
  TORCH_CHECK(mask.is_contiguous() && mask.numel() == q.size(0) * q.size(1) * total,
              "decode_attention: mask must be a contiguous [rows, 1, new, total] tensor");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type() &&
              q.scalar_type() == mask.scalar_type(), "decode_attention: q, keys, values and mask must share a dtype");
  check_float_dtype("decode_attention", q);
  auto out = torch::empty({q.size(0), q.size(1), q.size(2) * q.size(3)}, q.options());
  tgi::AttentionShape s{q.size(0), q.size(1), q.size(2), keys.size(1), total, q.size(3),
                        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
                        values.stride(0), values.stride(1), values.stride(2)};
  if (paged) set_paged(s, keys, values, *slots);
  if (q.scalar_type() == torch::kFloat) {
    tgi::attention(ptr<float>(q), ptr<float>(keys), ptr<float>(values), ptr<float>(mask), ptr<float>(out), s,
                   static_cast<float>(scale));
  } else {
    tgi::attention(ptr<uint16_t>(q), ptr<uint16_t>(keys), ptr<uint16_t>(values), ptr<uint16_t>(mask),
                   ptr<uint16_t>(out), s, static_cast<float>(scale));
  }
  return out;
}

// ---- one decoder layer -------------------------------------------------------------------------
// pool's slot slots[r, first + t] = src[r, t], for src rows of `token_stride` values (kv head g at g * dim);
// padding (slot 0, the zero block) is not stored.
template <typename T>
void write_columns(const Tensor& pool, const Tensor& slots, int64_t first, const T* src, int64_t rows,
                   int64_t new_tokens, int64_t token_stride) {
  const int64_t kv_heads = pool.size(1), block_size = pool.size(2), dim = pool.size(3), total = slots.size(1);
  T* base = ptr<T>(pool);
  const int64_t* ids = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < new_tokens; ++t) {
      const int64_t slot = ids[r * total + first + t];
      if (slot == 0) continue;
      T* column = base + slot / block_size * pool.stride(0) + slot % block_size * pool.stride(2);
      for (int64_t g = 0; g < kv_heads; ++g)
        std::memcpy(column + g * pool.stride(1), src + (r * new_tokens + t) * token_stride + g * dim,
                    dim * sizeof(T));
    }
}

// The intermediate rows of a layer, carved from one buffer kept per thread: a decode step
// allocates nothing but its output (each torch op cost a few us, ~15 of them per layer).
class Scratch {
 public:
  explicit Scratch(int64_t bytes) {
    thread_local std::vector<char> buffer;
    if (static_cast<int64_t>(buffer.size()) < bytes) buffer.resize(bytes);
    next_ = buffer.data();
  }
  template <typename T>
  T* take(int64_t count) {
    T* out = reinterpret_cast<T*>(next_);
    next_ += padded(count * static_cast<int64_t>(sizeof(T)));
    return out;
  }
  static int64_t padded(int64_t bytes) { return (bytes + 63) / 64 * 64; }

 private:
  char* next_;
};

struct LayerArgs {
  const Tensor &h, &in_norm, &mlp_norm, &k_pool, &v_pool, &slots, &cos, &sin, &mask;
  const Projection &qkv, &o_proj, &gate_up, &down;
  int64_t length, heads, kv_heads;
  float eps, scale;
};

// Same math and rounding steps as fast_llama.pre_attention/post_attention, on raw rows of T.
template <typename T>
Tensor layer_rows(const LayerArgs& a) {
  const int64_t rows = a.h.size(0), new_tokens = a.h.size(1), hidden = a.h.size(2), dim = a.k_pool.size(3);
  const int64_t m = rows * new_tokens, q_width = a.heads * dim, qk_width = q_width + a.kv_heads * dim;
  const int64_t qkv_width = a.qkv.n, inner = a.down.k, total = a.length + new_tokens;
  const int64_t widest = std::max({a.qkv.k, a.o_proj.k, a.gate_up.k, a.down.k, a.qkv.n, a.gate_up.n, hidden});
  const int64_t elements[] = {hidden, qkv_width, qk_width, q_width, hidden, hidden, a.gate_up.n, inner};
  int64_t bytes = 2 * Scratch::padded(m * widest * 4);
  for (int64_t width : elements) bytes += Scratch::padded(m * width * static_cast<int64_t>(sizeof(T)));
  Scratch scratch(bytes);
  T *normed = scratch.take<T>(m * hidden), *fused = scratch.take<T>(m * qkv_width);
  T *roped = scratch.take<T>(m * qk_width), *attn = scratch.take<T>(m * q_width);
  T *projected = scratch.take<T>(m * hidden), *h2 = scratch.take<T>(m * hidden);
  T *gate_up = scratch.take<T>(m * a.gate_up.n), *act = scratch.take<T>(m * inner);
  float *x32 = scratch.take<float>(m * widest), *y32 = scratch.take<float>(m * widest);
  auto out = torch::empty_like(a.h);
  const T* h = ptr<T>(a.h);

  tgi::rms_norm(h, ptr<T>(a.in_norm), normed, m, hidden, a.eps);
  a.qkv.apply(normed, fused, m, x32, y32);
  tgi::rope(fused, qkv_width, dim, ptr<T>(a.cos), ptr<T>(a.sin), roped, m, a.heads + a.kv_heads, dim);
  write_columns(a.k_pool, a.slots, a.length, roped + q_width, rows, new_tokens, qk_width);
  write_columns(a.v_pool, a.slots, a.length, fused + qk_width, rows, new_tokens, qkv_width);
  tgi::AttentionShape s{rows, new_tokens, a.heads, a.kv_heads, total, dim, new_tokens * qk_width, qk_width, dim,
                        0, 0, 0, 0, 0, 0};
  set_paged(s, a.k_pool, a.v_pool, a.slots);
  tgi::attention(roped, ptr<T>(a.k_pool), ptr<T>(a.v_pool), ptr<T>(a.mask), attn, s, a.scale);
  a.o_proj.apply(attn, projected, m, x32, y32);
  tgi::add(h, projected, h2, m * hidden);
  tgi::rms_norm(h2, ptr<T>(a.mlp_norm), normed, m, hidden, a.eps);
  a.gate_up.apply(normed, gate_up, m, x32, y32);
  tgi::silu_mul(gate_up, act, m, inner);
  a.down.apply(act, projected, m, x32, y32);
  tgi::add(h2, projected, ptr<T>(out), m * hidden);
  return out;
}

// h [rows, new, hidden]; k_pool/v_pool [blocks, kv_heads, block_size, dim], a paged cache's
// keys and values; slots [rows, length + new] the slot of each row's cache column, the last `new`
// written here; cos/sin [rows, new, 1, dim]; mask [rows, 1, new, length + new]; rows x new <= kMaxRows.
Tensor decode_layer(const Tensor& h, const Tensor& in_norm, const Projection& qkv, const Projection& o_proj,
                    const Tensor& mlp_norm, const Projection& gate_up, const Projection& down, const Tensor& k_pool,
                    const Tensor& v_pool, const Tensor& slots, const Tensor& cos, const Tensor& sin, const Tensor& mask,
                    int64_t heads, int64_t kv_heads, double eps, double scale) {
  TORCH_CHECK(h.dim() == 3 && h.is_contiguous(), "decode_layer: h must be a contiguous [rows, new, hidden]");
  check_float_dtype("decode_layer", h);
  const auto dtype = h.scalar_type();
  const int64_t rows = h.size(0), new_tokens = h.size(1), hidden = h.size(2), m = rows * new_tokens;
  TORCH_CHECK(m >= 1 && m <= tgi::kMaxRows, "decode_layer: ", m, " rows x new tokens; at most ", tgi::kMaxRows);
  check_pool("decode_layer", k_pool, v_pool, kv_heads, dtype);
  const int64_t dim = k_pool.size(3), length = slots.dim() == 2 ? slots.size(1) - new_tokens : -1;
  TORCH_CHECK(length >= 0, "decode_layer: slots must cover the cache and the ", new_tokens, " new columns, got ",
              slots.sizes());
  check_slots("decode_layer", slots, rows, length + new_tokens, k_pool);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && dim % 2 == 0, "decode_layer: ", heads,
              " heads over ", kv_heads, " kv heads of dim ", dim, " (heads a multiple of kv heads, dim even)");
  for (const Tensor* norm : {&in_norm, &mlp_norm})
    TORCH_CHECK(norm->is_contiguous() && norm->numel() == hidden && norm->scalar_type() == dtype,
                "decode_layer: norm weights must be ", hidden, " contiguous ", dtype, " values");
  for (const Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->is_contiguous() && table->numel() == m * dim && table->scalar_type() == dtype,
                "decode_layer: cos and sin must be contiguous [rows, new, 1, ", dim, "] of ", dtype);
  TORCH_CHECK(mask.is_contiguous() && mask.numel() == m * (length + new_tokens) && mask.scalar_type() == dtype,
              "decode_layer: mask must be a contiguous [rows, 1, new, ", length + new_tokens, "] of ", dtype);
  TORCH_CHECK(qkv.k == hidden && qkv.n == (heads + 2 * kv_heads) * dim && o_proj.k == heads * dim &&
              o_proj.n == hidden && gate_up.k == hidden && gate_up.n % 2 == 0 && down.k == gate_up.n / 2 &&
              down.n == hidden, "decode_layer: projection shapes do not fit hidden ", hidden, ", ", heads, " + 2 x ",
              kv_heads, " heads of ", dim);
  for (const Projection* p : {&qkv, &o_proj, &gate_up, &down}) p->check_input("decode_layer", dtype);
  const LayerArgs args{h, in_norm, mlp_norm, k_pool, v_pool, slots, cos, sin, mask, qkv, o_proj, gate_up, down,
                       length, heads, kv_heads, static_cast<float>(eps), static_cast<float>(scale)};
  return dtype == torch::kFloat ? layer_rows<float>(args) : layer_rows<uint16_t>(args);
}

}  // namespace

// The module's contents; each variant's kernels/module.cpp defines the module itself under its own
// name (tgi_cpu_kernels_<variant>), so several variants can live in one process (tests, benchmarks).
void tgi_define_module(pybind11::module_& module) {
  namespace py = pybind11;
  // module_local: each variant's module registers its own Projection type (tests load several).
  py::class_<Projection>(module, "Projection", py::module_local(), "a weight in one of the kernels' formats")
      .def_static("dense", &Projection::dense, "fp32/bf16 weight [n, k]")
      .def_static("four_bit", &Projection::four_bit, "bitsandbytes 4-bit codes, absmax, table, blocksize, n, k, bias",
                  py::arg("codes"), py::arg("absmax"), py::arg("table"), py::arg("blocksize"), py::arg("n"),
                  py::arg("k"), py::arg("bias"), py::arg("int8_x") = false)
      .def_static("int8", &Projection::int8, "bitsandbytes LLM.int8(): CB, SCB, bias, threshold")
      .def_static("int8_weights", &Projection::int8_weights,
                  "weight-only int8 in blocks: codes, scales, blocksize, bias", py::arg("codes"), py::arg("scales"),
                  py::arg("blocksize"), py::arg("bias"), py::arg("int8_x") = false)
      .def("__call__", &Projection::operator(), "x [m, k] -> [m, n]", py::arg("x"), py::arg("exact") = false)
      .def_readonly("n", &Projection::n)
      .def_readonly("k", &Projection::k)
      .def_property_readonly("nbytes", &Projection::nbytes, "bytes one product reads: weights, scales, bias")
      .def_property_readonly(
          "tensors",
          [](const Projection& p) {
            std::vector<Tensor> held;
            for (const Tensor* t : {&p.weight, &p.absmax, &p.table, &p.scales, &p.row_sums, &p.bias, &p.bias32})
              if (t->defined()) held.push_back(*t);
            return held;
          },
          "the tensors it holds (memory accounting)");
  module.def("small_m_linear", &small_m_linear, "y = x @ weight.T (+ bias) for 1..16 rows of x");
  module.def("rms_norm", &rms_norm, "transformers' RMSNorm in one pass (fp32 math)");
  module.def("decode_attention", &decode_attention, "attention of a few new queries per row against the cache",
             py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("mask"), py::arg("scale"),
             py::arg("slots") = py::none());
  module.def("rope", &rope, "x * cos + roll(x, dim / 2) * signed_sin");
  module.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up output");
  module.def("decode_layer", &decode_layer, "one Llama-family decoder layer for a few new tokens per row");
  module.attr("max_rows") = tgi::kMaxRows;
  module.attr("variant") = tgi::variant_name();
}
