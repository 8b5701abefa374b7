// The kernels' float32 entry points on raw pointers, for the fused decoder
// (decoder.cpp). They run the same code as the torch ops of ops.cpp, quant.cpp
// and paged_attention.cpp, so a fused forward equals the op-by-op one bit for bit.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace atom {

// paged_attention.cpp: whether the native variants run (set_native_kernels), read by every kernel that has one
bool native_kernels_enabled();

// ops.cpp: rows of n floats, contiguous
void rms_norm_f32(float* out, const float* x, const float* w, int64_t rows, int64_t n, float eps);
void add_rms_norm_f32(float* x, float* residual, const float* w, int64_t rows, int64_t n, float eps);
void silu_and_mul_f32(float* out, const float* x, int64_t rows, int64_t n);
void rotary_f32(float* q, int64_t q_stride, int64_t q_heads, float* k, int64_t k_stride, int64_t k_heads,
                int64_t tokens, int64_t D, const float* cos, const float* sin);
// the same four over bfloat16 rows (the torch ops' bfloat16 instances)
void rms_norm_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w, int64_t rows, int64_t n,
                   float eps);
void add_rms_norm_bf16(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w, int64_t rows, int64_t n,
                       float eps);
void silu_and_mul_bf16(c10::BFloat16* out, const c10::BFloat16* x, int64_t rows, int64_t n);
void rotary_bf16(c10::BFloat16* q, int64_t q_stride, int64_t q_heads, c10::BFloat16* k, int64_t k_stride,
                 int64_t k_heads, int64_t tokens, int64_t D, const float* cos, const float* sin);
// out [M, N] = x [M, K] W^T (+ bias), M in 1..4, W float32 [N, K]
void gemv_f32(float* out, const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias);

// quant.cpp: the same with W as GGUF blocks of ggml type `type`; rows of W dequantized
int64_t quant_row_bytes(int64_t type, int64_t K);
void qgemv_f32(float* out, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t type,
               const float* bias);
void dequantize_f32(float* out, const uint8_t* w, int64_t rows, int64_t K, int64_t type);  // rows of W, as the op

// gemm.cpp: the atom::amx_linear op (bfloat16 x [M, K], W packed as B tiles by ops.pack_amx_weight)
void amx_linear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias);

}  // namespace atom

// paged_attention.cpp (the torch op's implementation)
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                     int64_t block_size, double scale, int64_t sliding_window, const c10::optional<at::Tensor>& sinks,
                     int64_t partition = 0);
