// The kernels of one variant on raw pointers (cpu_kernels.cpp checks tensors and calls them).
//
// Row-major everywhere: x [m, k], weights [n, k], y [m, n]. bf16 values travel as their 16-bit
// patterns (uint16_t); every sum is fp32. Biases are fp32 (or null) and added once per output.
#pragma once

#include <cstdint>

namespace tgi {

constexpr int64_t kMaxRows = 16;  // activation rows of one product call (cpu_kernels.cpp chunks more)

// The variant this module was compiled as (cpu_kernels.py names the same strings).
const char* variant_name();

// ---- products (products.cpp) ------------------------------------------------------------------
void linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t k, int64_t n);
void linear_bf16(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t m, int64_t k,
                 int64_t n);

// Weight-only int8 in blocks along k: w[n, c] = codes[n, c] * scales[(n * k + c) / blocksize], blocks
// within rows (k a multiple of blocksize, a power of two >= 32); x is not quantized.
void linear_int8_weights(const float* x, const int8_t* w, const float* scales, int64_t blocksize, const float* bias,
                         float* y, int64_t m, int64_t k, int64_t n);
// The same weights against x quantized to int8 per 32 values (quantized.cpp, q8).
void linear_int8_weights_int8_x(const float* x, const int8_t* w, const float* scales, int64_t blocksize,
                                const float* bias, float* y, int64_t m, int64_t k, int64_t n);

// bitsandbytes' 4-bit layout, read as it is: element e of the flattened [n, k] weight is the
// high nibble (e even) or low nibble (e odd) of codes[e / 2], its value is
// table[nibble] * absmax[e / blocksize] (nf4 or fp4 table).
struct Packed4 {
  const uint8_t* codes;
  const float* absmax;
  const float* table;  // 16 values
  int64_t blocksize;   // a power of two >= 2 * kLanes (checked by the caller)
};
// round_bf16: round each dequantized weight to bf16 first (bnb dequantizes to the compute dtype).
// int8_x: x quantized to int8 per 32 values and integer dot products instead (quantized.cpp, q8).
void linear_4bit(const float* x, const Packed4& w, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
                 bool round_bf16, bool int8_x);

// LLM.int8() as bitsandbytes computes it on the CPU (quantized.cpp has the exact recipe).
struct Int8Weight {
  const int8_t* codes;  // CB [n, k], row-wise absmax quantized
  const float* scales;  // SCB [n]: absmax of each weight row
  const int32_t* row_sums;  // [n]: the sum of each row's codes (for VNNI's unsigned x)
};
void linear_int8(const float* x, const Int8Weight& w, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
                 float threshold, bool round_bf16);

// ---- elementwise (elementwise.cpp); T is float or uint16_t (bf16) -------------------------------
template <typename T>
void rms_norm(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps);
template <typename T>
void rope(const T* x, int64_t token_stride, int64_t head_stride, const T* cos, const T* sin, T* y, int64_t tokens,
          int64_t heads, int64_t dim);
template <typename T>
void silu_mul(const T* gate_up, T* y, int64_t tokens, int64_t inner);
// out = a + b in fp32, rounded once to T (torch's add of two T tensors); out may be a or b.
template <typename T>
void add(const T* a, const T* b, T* out, int64_t count);
// bf16 bits <-> fp32 (to bf16: round to nearest even, as torch's .to(torch.bfloat16)).
void widen_bf16(const uint16_t* x, float* y, int64_t count);
void narrow_bf16(const float* x, uint16_t* y, int64_t count);

// ---- attention (attention.cpp) ------------------------------------------------------------------
// q [rows, new, heads, dim] with strides (q_row, q_token, q_head); keys/values [rows, kv_heads,
// total, dim] with strides (row, head, column); mask [rows, 1, new, total] contiguous, additive;
// out [rows, new, heads * dim]. Query head h reads kv head h / (heads / kv_heads).
struct AttentionShape {
  int64_t rows, new_tokens, heads, kv_heads, total, dim;
  int64_t q_row, q_token, q_head;
  int64_t k_row, k_head, k_column;
  int64_t v_row, v_head, v_column;
  // Paged caches ([blocks, kv_heads, block_size, dim]): column t of row r is slot
  // slots[r * total + t], in block slot >> block_shift at place slot & (block_size - 1); k_block
  // and v_block are the blocks' strides (k_row and v_row unused, 0). Null: column t of the row.
  const int64_t* slots = nullptr;
  int64_t block_shift = 0, k_block = 0, v_block = 0;

  const int64_t* row_slots(int64_t row) const { return slots == nullptr ? nullptr : slots + row * total; }
  // Where column t of a row (its row_slots) starts, from the row's keys or values of one kv head.
  int64_t k_offset(const int64_t* row, int64_t t) const { return offset(row, t, k_block, k_column); }
  int64_t v_offset(const int64_t* row, int64_t t) const { return offset(row, t, v_block, v_column); }

 private:
  int64_t offset(const int64_t* row, int64_t t, int64_t block, int64_t column) const {
    if (row == nullptr) return t * column;
    const int64_t slot = row[t];
    return (slot >> block_shift) * block + (slot & ((int64_t{1} << block_shift) - 1)) * column;
  }
};
template <typename T>
void attention(const T* q, const T* keys, const T* values, const T* mask, T* out, const AttentionShape& shape,
               float scale);

}  // namespace tgi
