// The fused decoder: a whole Llama-family forward of a step in one call
// (models/fused.py builds it from a loaded model and says when it applies).
// The op-by-op path spends about 250 us a layer in Python and in the
// dispatcher around 170 us of kernels at SmolLM2's size; here the same
// kernels (and, past 4 rows, the same GEMMs) run back to back, so the results
// are the op-by-op path's bit for bit:
//
//   layer 0: x = rms_norm(residual = embed(ids))      later: x = add_rms_norm(x, residual)
//   qkv = x Wqkv^T (+ b); q, k rows normalised (Qwen3); rotary on q, k
//   k, v -> their slots of the paged cache; attn = paged_attention(q, cache)
//   x = attn Wo^T (+ b); x = add_rms_norm(x, residual)
//   x = (silu(x Wgate^T) * x Wup^T) Wdown^T
//   end: x = add_rms_norm(x, residual) with the final norm
//
// float32: every linear float32 (gemv up to 4 rows, torch's linear beyond) or
// GGUF blocks (qgemv up to 4 rows, dequantized slices and GEMMs beyond); batch-
// invariant (`use_batch_invariant`), gemv / qgemv at any row count, as
// BatchInvariantCpuOps runs them (each element one arithmetic whatever M); or
// GGUF blocks as quantized tiles on the float32 tile GEMM at any row count
// (qtile_f32.cpp, set_tile_qlinear: auto's invariance on an AVX2-only CPU).
// bfloat16 (`use_bfloat16`): activations, norms, embedding and caches bfloat16,
// each linear as CpuOps runs it op by op: on the tile GEMM at any row count
// (gemm.cpp, the weights packed as B tiles: on AMX, or AVX512-BF16's pair
// products without it or with cpu_amx off; GGUF blocks as quantized tiles,
// which the vector variant runs in the blocks' chain), or on oneDNN's packed weight,
// where a GGUF layer's 1-4 rows take the GEMV over
// its blocks in float32 arithmetic, rounded back (quant.cpu_linear). The attention's
// `partition` (batch invariance) comes with each step, as the op-by-op backend
// passes it; which kernel variants run (`native`, `amx`: the model's plan) is
// given at construction, as the op-by-op path's ops hold it.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t FLOAT = -1;  // a linear's type when its weight is float32

constexpr int64_t MAX_GEMV_ROWS = 4;  // up to here the GEMV kernels; a GEMM beyond (models/ops.py, quant.py)
constexpr int64_t MAX_F32_QGEMV_ROWS = 16;  // float32 over blocks: the GEMV up to here (quant.MAX_F32_GEMV_ROWS)

// oneDNN's GEMM over a weight it packed (torch.ops.mkldnn._linear_pointwise, as CpuOps.linear calls it)
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.defined() ? c10::IValue(bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<c10::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

struct Linear {
  at::Tensor weight;  // float32 [N, K], or uint8 rows of blocks
  int64_t qtype = FLOAT;
  at::Tensor bias;  // undefined: none
  int64_t N = 0, K = 0;
  int64_t slice_rows = 0;  // quantized, past the GEMV's rows: rows dequantized per GEMM (quant.slice_rows)
  at::Tensor dense;        // quantized: its float32 copy where the model keeps one (past the GEMV's rows, one GEMM)
  at::Tensor tiles;        // the weight as bfloat16's B tiles (ops.pack_tile_weight) or float32's panels
                           // (ops.pack_f32_tile_weight), any row count
  at::Tensor qtiles;       // GGUF blocks of type qtype as the quantized tiles (ops.pack_tile_qweight), any row
                           // count: bfloat16's tile GEMM (gemm.cpp) or float32's (qtile_f32.cpp)
  bool amx = false;        // tiles: on the AMX tiles (the decoder's amx), else AVX512-BF16's pair products
  at::Tensor onednn;       // bfloat16: the weight packed by oneDNN; past MAX_GEMV_ROWS, or at any count without blocks
  at::Tensor bias_f32;     // bfloat16 over blocks: the bias widened, as the qgemv op widens it
  bool any_rows = false;   // float32, batch-invariant: gemv / qgemv at any row count (BatchInvariantCpuOps)

  bool set() const { return weight.defined() || tiles.defined() || qtiles.defined() || onednn.defined(); }

  // x [M, K] contiguous -> x W^T (+ b) [M, N], as CpuOps.linear computes it for M rows
  at::Tensor run(const at::Tensor& x) const {
    const int64_t M = x.size(0);
    if (tiles.defined() && x.scalar_type() == at::kFloat) {
      at::Tensor out = at::empty({M, N}, x.options());
      atom::tile_linear_f32(out, x, tiles, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
      return out;
    }
    if (tiles.defined()) {
      at::Tensor out = at::empty({M, N}, x.options());
      atom::tile_linear_bf16(out, x, tiles, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt, amx);
      return out;
    }
    if (qtiles.defined() && x.scalar_type() == at::kFloat) {
      at::Tensor out = at::empty({M, N}, x.options());
      atom::tile_qlinear_f32(out, x, qtiles, qtype, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
      return out;
    }
    if (qtiles.defined()) {
      at::Tensor out = at::empty({M, N}, x.options());
      atom::tile_qlinear_bf16(out, x, qtiles, qtype, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                              amx);
      return out;
    }
    if (onednn.defined()) {
      if (M > MAX_GEMV_ROWS || !weight.defined()) return onednn_linear(x, onednn, bias);
      // the qgemv op on bfloat16 rows: widened exactly, float32 arithmetic, the result rounded back
      const at::Tensor xf = x.to(at::kFloat);
      at::Tensor of = at::empty({M, N}, xf.options());
      atom::qgemv_f32(of.data_ptr<float>(), xf.data_ptr<float>(), M, K, weight.data_ptr<uint8_t>(), N, qtype,
                      bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr);
      return of.to(at::kBFloat16);
    }
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (M <= MAX_GEMV_ROWS || any_rows || (qtype != FLOAT && M <= MAX_F32_QGEMV_ROWS)) {
      at::Tensor out = at::empty({M, N}, x.options());
      if (qtype == FLOAT)
        atom::gemv_f32(out.data_ptr<float>(), x.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, b);
      else
        atom::qgemv_f32(out.data_ptr<float>(), x.data_ptr<float>(), M, K, weight.data_ptr<uint8_t>(), N, qtype, b);
      return out;
    }
    if (qtype == FLOAT || dense.defined())
      return at::linear(x, qtype == FLOAT ? weight : dense,
                        bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
    // quant.cpu_linear: slices of dequantized rows, each through one GEMM while it is in cache
    const int64_t rows = slice_rows, row_bytes = weight.size(1);
    at::Tensor buffer = at::empty({std::min(rows, N), K}, x.options());
    at::Tensor out = at::empty({N, M}, x.options());
    const at::Tensor xt = x.t();
    for (int64_t start = 0; start < N; start += rows) {
      const int64_t n = std::min(rows, N - start);
      at::Tensor part = buffer.narrow(0, 0, n);
      atom::dequantize_f32(part.data_ptr<float>(), weight.data_ptr<uint8_t>() + start * row_bytes, n, K, qtype);
      at::Tensor dst = out.narrow(0, start, n);
      at::mm_out(dst, part, xt);
    }
    return (bias.defined() ? at::add(out.t(), bias) : out.t()).contiguous();
  }
};

struct Layer {
  at::Tensor input_norm, post_norm, q_norm, k_norm, sinks;  // the last three undefined when absent
  int64_t window = 0;                                       // 0: the whole context
  Linear qkv, o, gate_up, down;
};

void check_param(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu() && t.numel() == numel,
              "Decoder: ", name, " must be a contiguous ", dtype, " CPU tensor of ", numel, " values");
}

void check_float(const at::Tensor& t, int64_t numel, const char* name) { check_param(t, at::kFloat, numel, name); }

}  // namespace

// The shapes the layer loop runs, the kernels' multiples (the attention's 16 dims, 8 floats for the
// elementwise ops and the GEMV): why not, or "" (models/fused.py asks before it builds a Decoder)
std::string atom::decoder_unsupported_shape(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                            int64_t intermediate) {
  if (kv_heads <= 0 || heads % kv_heads != 0) return "num_attention_heads not a multiple of num_key_value_heads";
  if (head_dim % 16 != 0 || hidden % 8 != 0 || intermediate % 8 != 0)
    return "head_dim, hidden_size or intermediate_size off the kernels' multiples";
  return "";
}

namespace {

class Decoder : public torch::CustomClassHolder {
 public:
  // native: the kernels' native variants (else their portable twins); amx: bfloat16 attention on the AMX tiles
  Decoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
          bool native, bool amx)
      : hidden_(hidden),
        H_(heads),
        KVH_(kv_heads),
        D_(head_dim),
        I_(intermediate),
        eps_(float(eps)),
        native_(native),
        amx_(amx) {
    const std::string why = atom::decoder_unsupported_shape(hidden, heads, kv_heads, head_dim, intermediate);
    TORCH_CHECK(why.empty(), "Decoder: ", why);
  }

  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& sinks, int64_t window) {
    Layer layer;
    check_param(input_norm, dtype_, hidden_, "input_norm"), check_param(post_norm, dtype_, hidden_, "post_norm");
    layer.input_norm = input_norm, layer.post_norm = post_norm;
    if (q_norm.has_value()) check_param(*q_norm, dtype_, D_, "q_norm"), layer.q_norm = *q_norm;
    if (k_norm.has_value()) check_param(*k_norm, dtype_, D_, "k_norm"), layer.k_norm = *k_norm;
    TORCH_CHECK(layer.q_norm.defined() == layer.k_norm.defined(), "Decoder: q_norm and k_norm come together");
    if (sinks.has_value()) check_float(*sinks, H_, "sinks"), layer.sinks = *sinks;
    TORCH_CHECK(window >= 0, "Decoder: window must be >= 0");
    layer.window = window;
    layers_.push_back(layer);
  }

  // slot 0 qkv, 1 o, 2 gate_up, 3 down of the last layer added; slice_rows: see Linear
  void set_linear(int64_t slot, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias,
                  int64_t slice_rows) {
    TORCH_CHECK(dtype_ == at::kFloat, "Decoder: set_linear takes float32 or GGUF weights (bfloat16: set_tile_linear or set_onednn_linear)");
    Linear& lin = slot_linear(slot, "set_linear");
    TORCH_CHECK(weight.is_contiguous() && weight.device().is_cpu() && weight.dim() == 2 && weight.size(0) == lin.N,
                "Decoder: linear ", slot, " must be a contiguous CPU [", lin.N, ", ...] tensor");
    const bool fits = qtype == FLOAT ? weight.scalar_type() == at::kFloat && weight.size(1) == lin.K
                                     : weight.scalar_type() == at::kByte &&
                                           weight.size(1) == atom::quant_row_bytes(qtype, lin.K);
    TORCH_CHECK(fits, "Decoder: linear ", slot, " of type ", qtype, " does not match K = ", lin.K);
    TORCH_CHECK(qtype == FLOAT || slice_rows > 0, "Decoder: a quantized linear needs slice_rows > 0");
    lin.weight = weight, lin.qtype = qtype, lin.slice_rows = slice_rows, lin.any_rows = invariant_;
    if (bias.has_value()) check_float(*bias, lin.N, "bias"), lin.bias = *bias;
  }

  // float32 batch invariance (BatchInvariantCpuOps): every linear through gemv / qgemv at any row count,
  // each output element by one arithmetic whatever the step holds; before any layer is added
  void use_batch_invariant() {
    TORCH_CHECK(layers_.empty() && dtype_ == at::kFloat, "Decoder: use_batch_invariant comes first, in float32");
    invariant_ = true;
  }

  // bfloat16 activations, norms, embedding and caches, each linear on the tile GEMM (set_tile_linear) or
  // oneDNN's (set_onednn_linear); before any layer is added
  void use_bfloat16() {
    TORCH_CHECK(layers_.empty() && !embedding_.defined() && !norm_.defined(), "Decoder: use_bfloat16 comes first");
    dtype_ = at::kBFloat16;
  }

  // slot's weight (last layer added) as the tile GEMM's B tiles [ceil(N/16)][K/32][16][32] in bfloat16, or
  // float32's panels [ceil(N/16)][K][16] (ops.pack_f32_tile_weight, qtile_f32.cpp); bias in the decoder's dtype
  void set_tile_linear(int64_t slot, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
    Linear& lin = slot_linear(slot, "set_tile_linear");
    const bool fits = dtype_ == at::kBFloat16
                          ? packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(1) * 32 == lin.K
                          : packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(1) == lin.K &&
                                packed.size(2) == 16;
    TORCH_CHECK(packed.is_contiguous() && fits && packed.size(0) == (lin.N + 15) / 16, "Decoder: linear ", slot,
                " must be packed as tiles of the decoder's dtype for [", lin.N, ", ", lin.K, "]");
    lin.tiles = packed;
    lin.amx = amx_;
    if (bias.has_value()) check_param(*bias, dtype_, lin.N, "bias"), lin.bias = *bias;
  }

  // slot's weight (last layer added) as GGUF blocks of type qtype packed as the tile GEMM's quantized tiles
  // [ceil(N/16)][K/32][bytes] (ops.pack_tile_qweight), bias in the decoder's dtype: bfloat16 on the bfloat16
  // tile GEMM (gemm.cpp), float32 on the float32 one (qtile_f32.cpp)
  void set_tile_qlinear(int64_t slot, const at::Tensor& packed, int64_t qtype, const c10::optional<at::Tensor>& bias) {
    Linear& lin = slot_linear(slot, "set_tile_qlinear");
    TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                    packed.size(0) == (lin.N + 15) / 16 && packed.size(1) * 32 == lin.K,
                "Decoder: linear ", slot, " must be packed as quantized tiles for [", lin.N, ", ", lin.K, "]");
    lin.qtiles = packed, lin.qtype = qtype;
    lin.amx = amx_;
    if (bias.has_value()) check_param(*bias, dtype_, lin.N, "bias"), lin.bias = *bias;
  }

  // slot's weight (last layer added) packed by oneDNN (torch.ops.mkldnn._reorder_linear_weight), bias bfloat16;
  // blocks: a GGUF layer's own (uint8 rows of ggml type qtype), which serve 1-4 rows as in quant.cpu_linear
  void set_onednn_linear(int64_t slot, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& blocks, int64_t qtype) {
    TORCH_CHECK(dtype_ == at::kBFloat16, "Decoder: oneDNN linears run in bfloat16 (use_bfloat16)");
    Linear& lin = slot_linear(slot, "set_onednn_linear");
    TORCH_CHECK(packed.is_mkldnn() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 2 &&
                    packed.size(0) == lin.N && packed.size(1) == lin.K,
                "Decoder: linear ", slot, " must be a bfloat16 weight packed by oneDNN for [", lin.N, ", ", lin.K,
                "]");
    if (blocks.has_value()) {
      TORCH_CHECK(qtype != FLOAT && blocks->scalar_type() == at::kByte && blocks->is_contiguous() &&
                      blocks->dim() == 2 && blocks->size(0) == lin.N &&
                      blocks->size(1) == atom::quant_row_bytes(qtype, lin.K),
                  "Decoder: linear ", slot, "'s blocks of type ", qtype, " do not match [", lin.N, ", ", lin.K, "]");
      lin.weight = *blocks, lin.qtype = qtype;
    }
    lin.onednn = packed;
    if (bias.has_value()) {
      check_param(*bias, dtype_, lin.N, "bias"), lin.bias = *bias;
      lin.bias_f32 = bias->to(at::kFloat).contiguous();
    }
  }

  // the float32 copy of slot's quantized weight (last layer added), as quant.cpu_linear runs it past four rows
  void set_dense(int64_t slot, const at::Tensor& dense) {
    Linear& lin = slot_linear(slot, "set_dense");
    TORCH_CHECK(lin.qtype != FLOAT, "Decoder: set_dense on a float32 linear");
    check_float(dense, lin.N * lin.K, "dense");
    lin.dense = dense;
  }

  void set_embedding(const at::Tensor& weight, int64_t qtype) {
    TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "Decoder: the embedding must be contiguous 2-D");
    const bool fits = qtype == FLOAT ? weight.scalar_type() == dtype_ && weight.size(1) == hidden_
                                     : dtype_ == at::kFloat && weight.scalar_type() == at::kByte &&
                                           weight.size(1) == atom::quant_row_bytes(qtype, hidden_);
    TORCH_CHECK(fits, "Decoder: the embedding of type ", qtype, " does not match hidden_size ", hidden_);
    embedding_ = weight, embedding_qtype_ = qtype;
  }

  void set_norm(const at::Tensor& weight) { check_param(weight, dtype_, hidden_, "norm"), norm_ = weight; }

  // hidden states [T, hidden] of the step's tokens, after the final norm; the step's keys and values are
  // written to each layer's cache first. partition: the attention's (0, or the batch-invariant split)
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start, int64_t block_size, int64_t partition) {
    const int64_t T = input_ids.size(0), L = layers_.size();
    TORCH_CHECK(T >= 1, "Decoder: an empty step");
    TORCH_CHECK(norm_.defined() && embedding_.defined() && L > 0, "Decoder: not fully built");
    for (const Layer& layer : layers_)
      TORCH_CHECK(layer.qkv.set() && layer.o.set() && layer.gate_up.set() && layer.down.set(),
                  "Decoder: a layer's linears are not all set");
    check_caches(k_caches, v_caches);
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                    input_ids.is_contiguous() && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
                "Decoder: input_ids and slot_mapping must be contiguous int64 [T]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == T * D_ / 2 && sin.numel() == T * D_ / 2,
                "Decoder: cos and sin must be contiguous float32 [T, head_dim / 2]");
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < k_caches[0].size(0), "Decoder: slot ", slots[t], " is out of the cache");
    if (dtype_ == at::kBFloat16)
      return run<c10::BFloat16>(input_ids, cos, sin, k_caches, v_caches, slots, block_tables, seq_lens, query_start,
                                block_size, partition);
    return run<float>(input_ids, cos, sin, k_caches, v_caches, slots, block_tables, seq_lens, query_start, block_size,
                      partition);
  }

 private:
  // slot 0 qkv, 1 o, 2 gate_up, 3 down of the last layer added, its N and K set from the shape
  Linear& slot_linear(int64_t slot, const char* caller) {
    TORCH_CHECK(!layers_.empty() && slot >= 0 && slot < 4, "Decoder: ", caller, " before add_layer, or a bad slot");
    Layer& layer = layers_.back();
    const int64_t qkv_width = (H_ + 2 * KVH_) * D_;
    const int64_t shapes[4][2] = {{qkv_width, hidden_}, {hidden_, H_ * D_}, {2 * I_, hidden_}, {hidden_, I_}};
    Linear* linear[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    Linear& lin = *linear[slot];
    lin.N = shapes[slot][0], lin.K = shapes[slot][1];
    return lin;
  }

  template <typename S>  // the scalar type: float or c10::BFloat16
  at::Tensor run(const at::Tensor& input_ids, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, const int64_t* slots,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                 int64_t block_size, int64_t partition) {
    const int64_t T = input_ids.size(0), L = layers_.size();
    const int64_t W = (H_ + 2 * KVH_) * D_, kv_row = KVH_ * D_;
    const auto opts = at::TensorOptions().dtype(dtype_);
    at::Tensor residual = at::empty({T, hidden_}, opts);
    embed(input_ids.data_ptr<int64_t>(), T, residual.data_ptr<S>());
    S* r = residual.data_ptr<S>();
    at::Tensor x = at::empty({T, hidden_}, opts);  // the normalised rows into each layer, then its output
    at::Tensor q = at::empty({T, H_, D_}, opts), attn = at::empty({T, H_, D_}, opts);
    const double scale = 1.0 / std::sqrt(double(D_));
    const float *c = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
    for (int64_t l = 0; l < L; ++l) {
      const Layer& layer = layers_[l];
      if (l == 0)
        rms_norm(x.data_ptr<S>(), r, layer.input_norm.data_ptr<S>(), T, hidden_, eps_);
      else
        add_rms_norm(x.data_ptr<S>(), r, layer.input_norm.data_ptr<S>(), T, hidden_, eps_);
      const at::Tensor qkv = layer.qkv.run(x);
      S* qkvp = qkv.data_ptr<S>();
      if (layer.q_norm.defined()) {  // per head, in place
        for (int64_t t = 0; t < T; ++t) {
          S* row = qkvp + t * W;
          rms_norm(row, row, layer.q_norm.data_ptr<S>(), H_, D_, eps_);
          rms_norm(row + H_ * D_, row + H_ * D_, layer.k_norm.data_ptr<S>(), KVH_, D_, eps_);
        }
      }
      rotary(qkvp, W, H_, qkvp + H_ * D_, W, KVH_, T, D_, c, sn);
      const at::Tensor &k_cache = k_caches[l], &v_cache = v_caches[l];
      char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
      const auto cache = k_cache.scalar_type();
      const int64_t cache_row = kv_row * k_cache.element_size();
      S* qp = q.data_ptr<S>();
      at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const S* row = qkvp + t * W;
          std::memcpy(qp + t * H_ * D_, row, H_ * D_ * sizeof(S));
          atom::store_kv_row(kc + slots[t] * cache_row, cache, row + H_ * D_, kv_row);
          atom::store_kv_row(vc + slots[t] * cache_row, cache, row + (H_ + KVH_) * D_, kv_row);
        }
      });
      atom::op::paged_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, query_start, block_size, scale,
                                layer.window,
                                layer.sinks.defined() ? c10::optional<at::Tensor>(layer.sinks) : c10::nullopt,
                                partition, native_, amx_);
      x = layer.o.run(attn.view({T, H_ * D_}));
      add_rms_norm(x.data_ptr<S>(), r, layer.post_norm.data_ptr<S>(), T, hidden_, eps_);
      const at::Tensor gate_up = layer.gate_up.run(x);
      at::Tensor act = at::empty({T, I_}, opts);
      silu_and_mul(act.data_ptr<S>(), gate_up.data_ptr<S>(), T, I_);
      x = layer.down.run(act);
    }
    add_rms_norm(x.data_ptr<S>(), r, norm_.data_ptr<S>(), T, hidden_, eps_);
    return x;
  }

  // the ops.cpp kernels by dtype, native_ or their portable twins
  void rms_norm(float* o, const float* x, const float* w, int64_t rows, int64_t n, float eps) const {
    atom::rms_norm_f32(o, x, w, rows, n, eps, native_);
  }
  void rms_norm(c10::BFloat16* o, const c10::BFloat16* x, const c10::BFloat16* w, int64_t rows, int64_t n,
                float eps) const {
    atom::rms_norm_bf16(o, x, w, rows, n, eps, native_);
  }
  void add_rms_norm(float* x, float* r, const float* w, int64_t rows, int64_t n, float eps) const {
    atom::add_rms_norm_f32(x, r, w, rows, n, eps, native_);
  }
  void add_rms_norm(c10::BFloat16* x, c10::BFloat16* r, const c10::BFloat16* w, int64_t rows, int64_t n,
                    float eps) const {
    atom::add_rms_norm_bf16(x, r, w, rows, n, eps, native_);
  }
  void silu_and_mul(float* o, const float* x, int64_t rows, int64_t n) const {
    atom::silu_and_mul_f32(o, x, rows, n, native_);
  }
  void silu_and_mul(c10::BFloat16* o, const c10::BFloat16* x, int64_t rows, int64_t n) const {
    atom::silu_and_mul_bf16(o, x, rows, n, native_);
  }
  void rotary(float* q, int64_t qs, int64_t qh, float* k, int64_t ks, int64_t kh, int64_t t, int64_t D, const float* c,
              const float* s) const {
    atom::rotary_f32(q, qs, qh, k, ks, kh, t, D, c, s, native_);
  }
  void rotary(c10::BFloat16* q, int64_t qs, int64_t qh, c10::BFloat16* k, int64_t ks, int64_t kh, int64_t t,
              int64_t D, const float* c, const float* s) const {
    atom::rotary_bf16(q, qs, qh, k, ks, kh, t, D, c, s, native_);
  }

  void check_caches(const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "Decoder: one cache per layer");
    for (const auto* caches : {&k_caches, &v_caches})
      for (const at::Tensor& c : *caches)
        TORCH_CHECK((c.scalar_type() == dtype_ || c.scalar_type() == at::kFloat8_e5m2 ||
                     c.scalar_type() == at::kFloat8_e4m3fn) &&
                        c.scalar_type() == k_caches[0].scalar_type() && c.is_contiguous() && c.dim() == 3 &&
                        c.size(1) == KVH_ && c.size(2) == D_ && c.size(0) == k_caches[0].size(0),
                    "Decoder: caches must be contiguous [slots, kv_heads, head_dim] of one dtype: ", dtype_,
                    ", float8_e5m2 or float8_e4m3fn");
  }

  template <typename S>
  void embed(const int64_t* ids, int64_t T, S* out) const {
    const int64_t vocab = embedding_.size(0);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "Decoder: token id ", ids[t], " is out of the vocabulary");
      if (embedding_qtype_ == FLOAT)
        std::memcpy(out + t * hidden_, embedding_.data_ptr<S>() + ids[t] * hidden_, hidden_ * sizeof(S));
      else if constexpr (std::is_same_v<S, float>)
        atom::dequantize_f32(out + t * hidden_, embedding_.data_ptr<uint8_t>() + ids[t] * embedding_.size(1), 1,
                             hidden_, embedding_qtype_);
    }
  }

  int64_t hidden_, H_, KVH_, D_, I_;
  float eps_;
  bool native_, amx_;
  at::ScalarType dtype_ = at::kFloat;
  bool invariant_ = false;
  std::vector<Layer> layers_;
  at::Tensor embedding_, norm_;
  int64_t embedding_qtype_ = FLOAT;
};

}  // namespace

void atom::register_decoder(torch::Library& m) {
  m.class_<Decoder>("Decoder")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, bool>())
      .def("add_layer", &Decoder::add_layer)
      .def("set_linear", &Decoder::set_linear)
      .def("set_dense", &Decoder::set_dense)
      .def("use_bfloat16", &Decoder::use_bfloat16)
      .def("use_batch_invariant", &Decoder::use_batch_invariant)
      .def("set_tile_linear", &Decoder::set_tile_linear)
      .def("set_tile_qlinear", &Decoder::set_tile_qlinear)
      .def("set_onednn_linear", &Decoder::set_onednn_linear)
      .def("set_embedding", &Decoder::set_embedding)
      .def("set_norm", &Decoder::set_norm)
      .def("forward", &Decoder::forward);
}
