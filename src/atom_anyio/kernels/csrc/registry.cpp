// The torch.ops.atom library: every op's schema and CPU implementation, and the fused decoder's
// class (decoder.cpp lists its methods). Which variants run is no setting of the process: the ops
// that have native variants take `native` (and the attention `amx`) with each call, from the
// model's plan (models/plan.py).

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "vec.h"

namespace {

// the variants this build runs beyond the portable (AVX2 or plain) code, by name
std::vector<std::string> native_kernels() {
  std::vector<std::string> names;
#ifdef ATOM_AVX512_BF16
  names.push_back("paged_attention_avx512_bf16");
  names.push_back("linear_avx512_bf16");  // gemm.cpp's vector variant of the tile linears
#ifdef __GFNI__
  names.push_back("fp8_kv_gfni");  // that variant widens fp8 KV by GFNI's affine maps
#endif
#endif
#ifdef ATOM_AMX_BF16
  if (atom::amx_permitted()) {
    names.push_back("paged_attention_amx_bf16");
    names.push_back("linear_amx_bf16");  // gemm.cpp
  }
#endif
#ifdef ATOM_ELEMENTWISE_AVX512
  names.push_back("elementwise_avx512");  // ops.cpp
#endif
#if defined(__AVX2__) && defined(__FMA__)
  names.push_back("linear_f32_avx2");  // qtile_f32.cpp's float32 tile linears
#endif
  return names;
}

}  // namespace

TORCH_LIBRARY(atom, m) {
  // what this build has
  m.def("native_kernels() -> str[]", &native_kernels);
  // paged_attention.cpp
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start, int block_size, float scale, int sliding_window, "
      "Tensor? sinks, int partition, bool native, bool amx) -> ()");
  m.def("fp8_bf16_words(Tensor(a!) out, Tensor bytes, bool e5m2, bool affine) -> ()");
  // ops.cpp
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool native) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, bool native) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x, bool native) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool native) -> ()");
  m.def("gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  // quant.cpp
  m.def("qgemv(Tensor(a!) out, Tensor x, Tensor weight, int qtype, Tensor? bias) -> ()");
  m.def("dequantize(Tensor(a!) out, Tensor weight, int qtype) -> ()");
  // gemm.cpp
  m.def("tile_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, bool amx) -> ()");
  m.def("tile_qlinear(Tensor(a!) out, Tensor x, Tensor weight, int qtype, Tensor? bias, bool amx) -> ()");
  // qtile_f32.cpp
  m.def("tile_qlinear_f32(Tensor(a!) out, Tensor x, Tensor weight, int qtype, Tensor? bias, bool native) -> ()");
  m.def("tile_linear_f32(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, bool native) -> ()");
  // decoder.cpp
  m.def("decoder_unsupported_shape(int hidden, int heads, int kv_heads, int head_dim, int intermediate) -> str",
        &atom::decoder_unsupported_shape);
  atom::register_decoder(m);
}

TORCH_LIBRARY_IMPL(atom, CPU, m) {
  m.impl("paged_attention", &atom::op::paged_attention);
  m.impl("fp8_bf16_words", &atom::op::fp8_bf16_words);
  m.impl("rms_norm", &atom::op::rms_norm);
  m.impl("add_rms_norm", &atom::op::add_rms_norm);
  m.impl("silu_and_mul", &atom::op::silu_and_mul);
  m.impl("rotary_embedding", &atom::op::rotary_embedding);
  m.impl("gemv", &atom::op::gemv);
  m.impl("store_kv", &atom::op::store_kv);
  m.impl("qgemv", &atom::op::qgemv);
  m.impl("dequantize", &atom::op::dequantize);
  m.impl("tile_linear", &atom::op::tile_linear);
  m.impl("tile_qlinear", &atom::op::tile_qlinear);
  m.impl("tile_qlinear_f32", &atom::op::tile_qlinear_f32);
  m.impl("tile_linear_f32", &atom::op::tile_linear_f32);
}
