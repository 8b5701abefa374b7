// Float32 linears over GGUF blocks packed as quantized tiles (ops.pack_tile_qweight, the layout the
// bfloat16 tile GEMM reads: [ceil(N/16)][K/32][bytes], a tile holding 16 columns' blocks of 32 dims,
// row r their dims 2r and 2r + 1, then the columns' d and m as float16; K-quants' sub-blocks of 32 too,
// with float32 scales, kernels.h):
//
//   tile_qlinear_f32:  out [M, N] = x [M, K] W^T (+ bias), float32, any M
//   tile_linear_f32:   the same over float32 weights packed as panels [ceil(N/16)][K][16]
//                      (ops.pack_f32_tile_weight: a column block's 16 weights side by side per dim)
//
// Each output element is one chain whatever M is: a zeroed accumulator, fma(x[k], w[k], acc) for k
// in order, then + bias (none without one), where w[k] is the reference's dequantized weight (quant.py:
// d q + m, d (q - 8), d q; Q4_K's s q + m, Q6_K's s q, as gguf's dequantize rounds them), so
// batch-invariant by construction and the dense copy's GEMM to within summation order. The portable
// twin computes the chain one element at a time (std::fma); the AVX2 variant (qtile_f32_avx2.h) eight
// columns to a register, its GEMV at 1-4 rows and its GEMM beyond equal to the twin bit for bit. Where the CPU has AVX2 and no AVX512, float32 GGUF linears run here
// by default (models/loader.py): faster than MKL's GEMM over a dense copy at prefill sizes, no dense
// copy in memory, and the same bits at every batch size (docs/engine.md, "Batch invariance").

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <cstring>

#include "kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include "qtile_f32_avx2.h"
#endif

namespace {

using namespace atom;

// the float32 stored at p (a K-quant tile's scale)
inline float float_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

// column c's scale i of a tile: 0, its d (K-quants' s); 1, Q4_1's or Q4_K's m, Q6_K's s of dims 16-31
inline float tile_scale(int64_t type, const uint8_t* tile, int c, int i) {
  const uint8_t* s = tile + q_scales_at(type);
  return is_k_quant(type) ? float_at(s + 64 * i + 4 * c) : half_at(s + 32 * i + 2 * c);
}

// column c's weight at dim k (0-31) of a tile, as the reference dequantizes it
inline float tile_weight(int64_t type, const uint8_t* tile, int c, int k) {
  const int r = k / 2, t = k % 2;
  if (type == Q8_0 || type == Q6_K)  // int8 weights
    return tile_scale(type, tile, c, type == Q6_K && k >= 16) * float(int8_t(tile[r * 32 + 2 * c + t]));
  const int q = t ? tile[r * 16 + c] >> 4 : tile[r * 16 + c] & 15;
  if (type == Q4_0) return tile_scale(type, tile, c, 0) * float(q - 8);
  // d q is exact (an 11- or 17-bit scale by a 4-bit q), then one rounding as the reference's
  return tile_scale(type, tile, c, 0) * float(q) + tile_scale(type, tile, c, 1);
}

void portable(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t KB, int64_t tb, int64_t type,
              float* out, int64_t N, const float* bias) {
  std::vector<float> col(K);
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* block = w + (n / 16) * KB * tb;
    for (int64_t k = 0; k < K; ++k) col[k] = tile_weight(type, block + (k / 32) * tb, int(n % 16), int(k % 32));
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * K + k], col[k], acc);
      out[m * N + n] = bias ? acc + bias[n] : acc;
    }
  }
}

void portable_dense(const float* x, int64_t M, int64_t K, const float* w, float* out, int64_t N, const float* bias) {
  for (int64_t n = 0; n < N; ++n) {
    const float* col = w + (n / 16) * K * 16 + n % 16;  // dim k at col[k * 16]
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * K + k], col[k * 16], acc);
      out[m * N + n] = bias ? acc + bias[n] : acc;
    }
  }
}

// the checks both ops make; the bias padded to the blocks' columns (the vectors read 8 at a time), or undefined
at::Tensor checked_bias(const char* name, const at::Tensor& out, const at::Tensor& x, int64_t NB, int64_t K,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == K, name,
              ": x must be [M, K] float32 with K = ", K);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == x.size(0) &&
                  (out.size(1) + 15) / 16 == NB,
              name, ": out must be [M, N] float32 for ", NB, " column blocks");
  if (!bias || !bias->defined()) return at::Tensor();
  const int64_t N = out.size(1);
  TORCH_CHECK(bias->numel() == N, name, ": bias must have N elements");
  at::Tensor b = at::zeros({NB * 16}, x.options());
  b.narrow(0, 0, N).copy_(bias->reshape({N}));
  return b;
}

}  // namespace

namespace atom::op {

// `native`: the AVX2 variant where the build has it, else (and with native=false) the portable twin
void tile_qlinear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& wq, int64_t qtype,
                      const c10::optional<at::Tensor>& bias, bool native) {
  TORCH_CHECK(has_qtiles(qtype), "tile_qlinear_f32: type ", qtype, " has no tiles");
  TORCH_CHECK(wq.dim() == 3 && wq.is_contiguous() && wq.scalar_type() == at::kByte && wq.size(2) == qtile_bytes(qtype),
              "tile_qlinear_f32: the weight must be packed as tiles of type ", qtype);
  const at::Tensor b = checked_bias("tile_qlinear_f32", out, x, wq.size(0), wq.size(1) * 32, bias);
  const int64_t M = x.size(0), K = x.size(1), NB = wq.size(0), KB = wq.size(1), N = out.size(1);
  if (M == 0) return;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = wq.data_ptr<uint8_t>();
  const int64_t tb = qtile_bytes(qtype);
#if defined(__AVX2__) && defined(__FMA__)
  if (native) {
    float* op = out.data_ptr<float>();
    if (qtype == Q4_1) return qtile_avx2::linear<Q4_1>(xp, M, K, wp, NB, KB, tb, op, N, bp);
    if (qtype == Q4_0) return qtile_avx2::linear<Q4_0>(xp, M, K, wp, NB, KB, tb, op, N, bp);
    if (qtype == Q4_K) return qtile_avx2::linear<Q4_K>(xp, M, K, wp, NB, KB, tb, op, N, bp);
    if (qtype == Q6_K) return qtile_avx2::linear<Q6_K>(xp, M, K, wp, NB, KB, tb, op, N, bp);
    return qtile_avx2::linear<Q8_0>(xp, M, K, wp, NB, KB, tb, op, N, bp);
  }
#endif
  portable(xp, M, K, wp, KB, tb, qtype, out.data_ptr<float>(), N, bp);
}

// the same over float32 weights packed as panels [ceil(N/16)][K][16] (ops.pack_f32_tile_weight)
void tile_linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                     bool native) {
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && wp.scalar_type() == at::kFloat && wp.size(2) == 16,
              "tile_linear_f32: the weight must be float32 packed as panels [ceil(N/16), K, 16]");
  const at::Tensor b = checked_bias("tile_linear_f32", out, x, wp.size(0), wp.size(1), bias);
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), N = out.size(1);
  if (M == 0) return;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
  if (native) return qtile_avx2::linear_dense(x.data_ptr<float>(), M, K, wp.data_ptr<float>(), NB,
                                              out.data_ptr<float>(), N, bp);
#endif
  portable_dense(x.data_ptr<float>(), M, K, wp.data_ptr<float>(), out.data_ptr<float>(), N, bp);
}

}  // namespace atom::op

namespace atom {
void tile_linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias) {
  op::tile_linear_f32(out, x, packed, bias, true);
}
void tile_qlinear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                      const c10::optional<at::Tensor>& bias) {
  op::tile_qlinear_f32(out, x, packed, qtype, bias, true);
}
}  // namespace atom
