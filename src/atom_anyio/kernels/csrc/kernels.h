// The kernels' entry points across files: the torch ops that registry.cpp
// registers (atom::op), and the float32 entry points on
// raw pointers for the fused decoder (decoder.cpp), which run the same code as
// the torch ops of ops.cpp, quant.cpp and paged_attention.cpp, so a fused
// forward equals the op-by-op one bit for bit.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace torch {
class Library;
}

namespace atom {

// the GGUF block types the kernels take (quant.cpp's GEMVs, gemm.cpp's tiles: Q4_0, Q4_1, Q8_0), by ggml's type ids
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
// super-blocks of 256 (the K-quants), against the blocks of 32
constexpr bool is_k_quant(int64_t type) { return type == Q4_K || type == Q6_K; }
// the types packed as quantized tiles (below): every type the kernels take
constexpr bool has_qtiles(int64_t type) { return type == Q4_0 || type == Q4_1 || type == Q8_0 || is_k_quant(type); }

// a float16 stored at p (a block's d or m)
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

// GGUF blocks packed as quantized tiles (ops.pack_tile_qweight; gemm.cpp's bfloat16 and qtile_f32.cpp's float32
// tile GEMMs): 16 rows of weights (16 bytes of nibbles, or 32 int8 for Q8_0), then the 16 columns' d and (Q4_1) m
// as float16. K-quants have tiles on the float32 GEMM only, a sub-block of 32 a tile, with float32 scales (the
// exact products of d and a sub-block's 6- or 8-bit scale): Q4_K's nibbles as Q4_1's, then the columns' 16 s and
// 16 m (w = s q + m); Q6_K's q - 32 as Q8_0's int8, then 16 s for dims 0-15 and 16 for dims 16-31 (w = s q)
constexpr int64_t Q4_TILE_BYTES = 16 * 16 + 2 * 16 * 2, Q8_TILE_BYTES = 16 * 32 + 16 * 2;
constexpr int64_t Q4K_TILE_BYTES = 16 * 16 + 2 * 16 * 4, Q6K_TILE_BYTES = 16 * 32 + 2 * 16 * 4;
inline int64_t qtile_bytes(int64_t type) {
  switch (type) {
    case Q8_0: return Q8_TILE_BYTES;
    case Q4_K: return Q4K_TILE_BYTES;
    case Q6_K: return Q6K_TILE_BYTES;
    default: return Q4_TILE_BYTES;
  }
}
// where a tile's scales begin: after its 16 rows of weights
constexpr int64_t q_scales_at(int64_t type) { return type == Q8_0 || type == Q6_K ? 16 * 32 : 16 * 16; }

// Which variants run comes with each call, from the model's plan (models/plan.py): `native`, the native
// variants where built (false: their portable twins, cpu_native_kernels), and `amx`, bfloat16 attention on
// the AMX tiles where built and lent (false: the AVX512-BF16 variant, as without AMX; cpu_amx), for the attention
// and the bfloat16 tile linears alike.

// decoder.cpp: the Decoder class and its methods, into the library; why the layer loop cannot run a
// model of this shape, or ""
void register_decoder(torch::Library& m);
std::string decoder_unsupported_shape(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      int64_t intermediate);

// ops.cpp: rows of n floats, contiguous; native: the sixteen-lane variant where built
void rms_norm_f32(float* out, const float* x, const float* w, int64_t rows, int64_t n, float eps, bool native);
void add_rms_norm_f32(float* x, float* residual, const float* w, int64_t rows, int64_t n, float eps, bool native);
void silu_and_mul_f32(float* out, const float* x, int64_t rows, int64_t n, bool native);
void rotary_f32(float* q, int64_t q_stride, int64_t q_heads, float* k, int64_t k_stride, int64_t k_heads,
                int64_t tokens, int64_t D, const float* cos, const float* sin, bool native);
// the same four over bfloat16 rows (the torch ops' bfloat16 instances)
void rms_norm_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w, int64_t rows, int64_t n,
                   float eps, bool native);
void add_rms_norm_bf16(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w, int64_t rows, int64_t n,
                       float eps, bool native);
void silu_and_mul_bf16(c10::BFloat16* out, const c10::BFloat16* x, int64_t rows, int64_t n, bool native);
void rotary_bf16(c10::BFloat16* q, int64_t q_stride, int64_t q_heads, c10::BFloat16* k, int64_t k_stride,
                 int64_t k_heads, int64_t tokens, int64_t D, const float* cos, const float* sin, bool native);
// out [M, N] = x [M, K] W^T (+ bias), any M >= 1 (each element one arithmetic whatever M), W float32 [N, K]
void gemv_f32(float* out, const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias);

// quant.cpp: the same with W as GGUF blocks of ggml type `type` (the int16 GEMV's arithmetic at any M); rows of
// W dequantized
int64_t quant_row_bytes(int64_t type, int64_t K);
void qgemv_f32(float* out, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t type,
               const float* bias);
void dequantize_f32(float* out, const uint8_t* w, int64_t rows, int64_t K, int64_t type);  // rows of W, as the op

// n values of src into a KV cache row of dtype `cache`: src's own (a copy), or fp8 (kv_cache_dtype:
// float8_e5m2 or float8_e4m3fn), each saturated to the format's largest finite value and rounded to
// nearest even as torch converts (the store_kv op's rows, and the fused decoder's)
template <typename S>
void store_kv_row(void* dst, at::ScalarType cache, const S* src, int64_t n);

// gemm.cpp: the atom::tile_linear op (bfloat16 x [M, K], W packed as B tiles by ops.pack_tile_weight; amx: on
// the AMX tiles where built and lent, else AVX512-BF16's pair products)
void tile_linear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, bool amx);
// the atom::tile_qlinear op (W as GGUF blocks of type qtype packed by ops.pack_tile_qweight)
void tile_qlinear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                       const c10::optional<at::Tensor>& bias, bool amx);
// qtile_f32.cpp: the atom::tile_qlinear_f32 op's native variant (float32 x, the same packed tiles)
void tile_qlinear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                      const c10::optional<at::Tensor>& bias);
// the atom::tile_linear_f32 op's native variant (float32 weights packed as panels)
void tile_linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias);

}  // namespace atom

// the torch ops' implementations (registry.cpp gives their schemas)
namespace atom::op {

// paged_attention.cpp
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                     int64_t block_size, double scale, int64_t sliding_window, const c10::optional<at::Tensor>& sinks,
                     int64_t partition, bool native, bool amx);
void fp8_bf16_words(at::Tensor& out, const at::Tensor& bytes, bool e5m2, bool affine);

// ops.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps, bool native);
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps, bool native);
void silu_and_mul(at::Tensor& out, const at::Tensor& x, bool native);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, bool native);
void gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b);
void store_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping);

// quant.cpp
void qgemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& b);
void dequantize(at::Tensor& out, const at::Tensor& w, int64_t type);

// gemm.cpp
void tile_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                 bool amx);
void tile_qlinear(at::Tensor& out, const at::Tensor& x, const at::Tensor& wq, int64_t qtype,
                  const c10::optional<at::Tensor>& bias, bool amx);

// qtile_f32.cpp
void tile_qlinear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& wq, int64_t qtype,
                      const c10::optional<at::Tensor>& bias, bool native);
void tile_linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                     bool native);

}  // namespace atom::op
