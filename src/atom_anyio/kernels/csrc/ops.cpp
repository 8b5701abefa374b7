// Fused elementwise ops of a decoder layer on CPU: one pass over memory and
// one dispatch where the torch reference spends six to twelve ops. Each has
// its reference in models/ops.py (TorchOps) and a test against it.
//
// rms_norm:          out = x * rsqrt(mean(x^2) + eps) * w      (rows of x)
// add_rms_norm:      residual += x; x = rms_norm(residual)     (in place)
// silu_and_mul:      out = silu(x[:, :n]) * x[:, n:]
// rotary_embedding:  q, k rotated in place (rotate-half / NeoX layout)
//                    by cos, sin [T, D/2] float32
// gemv:              out = x W^T (+ b) for any number of rows of x, float32, each
//                    element by one arithmetic whatever the rows (gemm_f32.h): a
//                    decode's 1-4 rows stream the weights once, in order; more run
//                    as a blocked GEMM of the same arithmetic (batch invariance)
//
// The elementwise ops have a native variant where the CPU has AVX512F/BW
// ("elementwise_avx512"): sixteen lanes in place of eight, each lane computed
// by the same operations in the same order, so it equals the portable twin
// bit for bit (tests/models/test_kernels.py). float32 and bfloat16 rows take
// it when the op's `native` is true (the model's plan: cpu_native_kernels);
// float16 keeps the portable code.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>
#include <vector>

#include "gemm_f32.h"
#include "kernels.h"
#include "vec.h"

namespace {

using namespace atom;

#ifdef ATOM_ELEMENTWISE_AVX512
// Sixteen lanes: the V8 operations of vec.h at twice the width, each lane the same bits.
struct V16 {
  __m512 v;
};
inline V16 splat16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
// vec.h's exp, op for op
inline V16 exp(V16 a) {
  __m512 x = a.v;
  const __m512 lo = _mm512_set1_ps(-EXP_MAX);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_MAX)), lo);
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_HI), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_LO), x);
  __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[i]));
  y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return {_mm512_maskz_mov_ps(_knot_mask16(tiny), _mm512_mul_ps(y, _mm512_castsi512_ps(e)))};
}
// float -> bfloat16 bits in each lane's low half, to nearest even, NaN 0x7FC0 (vec.h's bf16_bits)
inline __m512i bf16_bits16(V16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
template <typename T>
inline V16 load16_as_float(const T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
  } else {
    return {_mm512_loadu_ps(p)};
  }
}
template <typename T>
inline V16 round16_as(V16 a) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(a), 16))};
  } else {
    return a;
  }
}
template <typename T>
inline void store16_as(T* p, V16 a) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(a)));
  } else {
    _mm512_storeu_ps(p, a.v);
  }
}
// the element types the sixteen-lane variant takes
template <typename T>
constexpr bool WIDE = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#endif

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps, bool native) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += float(x[i]) * float(x[i]);
  const float inv = 1.f / std::sqrt(sum / float(n) + eps);
  // the reference rounds the normalised row to the model dtype before the weight
  int64_t i = 0;
#ifdef ATOM_ELEMENTWISE_AVX512
  if constexpr (WIDE<T>) if (native)
    for (; i + 16 <= n; i += 16)
      store16_as(out + i, mul(load16_as_float(w + i), round16_as<T>(mul(load16_as_float(x + i), splat16(inv)))));
#endif
  for (; i + 8 <= n; i += 8)
    store_as(out + i, mul(load_as_float(w + i), round_as<T>(mul(load_as_float(x + i), splat(inv)))));
  for (; i < n; ++i) out[i] = T(float(w[i]) * float(T(float(x[i]) * inv)));
}

template <typename T>
void rms_norm_rows(T* op, const T* xp, const T* wp, int64_t rows, int64_t n, float eps, bool native) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * n, wp, op + r * n, n, eps, native);
  });
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps, bool native) {
  const int64_t n = x.size(-1);
  rms_norm_rows(out.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<T>(), x.numel() / n, n, float(eps), native);
}

template <typename T>
void add_rms_norm_rows(T* xp, T* rp, const T* wp, int64_t rows, int64_t n, float eps, bool native) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* xr = xp + r * n;
      T* rr = rp + r * n;
      int64_t i = 0;
#ifdef ATOM_ELEMENTWISE_AVX512
      if constexpr (WIDE<T>) if (native)
        for (; i + 16 <= n; i += 16) store16_as(rr + i, add(load16_as_float(rr + i), load16_as_float(xr + i)));
#endif
      for (; i + 8 <= n; i += 8) store_as(rr + i, add(load_as_float(rr + i), load_as_float(xr + i)));
      for (; i < n; ++i) rr[i] = T(float(rr[i]) + float(xr[i]));
      rms_norm_row(rr, wp, xr, n, eps, native);
    }
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps, bool native) {
  const int64_t n = x.size(-1);
  add_rms_norm_rows(x.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<T>(), x.numel() / n, n, float(eps),
                    native);
}

template <typename T>
void silu_and_mul_rows(T* op, const T* xp, int64_t rows, int64_t n, bool native) {
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* gate = xp + r * 2 * n;
      const T* up = gate + n;
      T* o = op + r * n;
      int64_t i = 0;
#ifdef ATOM_ELEMENTWISE_AVX512
      if constexpr (WIDE<T>) if (native)
        for (; i + 16 <= n; i += 16) {
          const V16 g = load16_as_float(gate + i);
          const V16 silu = div(g, add(splat16(1.f), exp(sub(splat16(0.f), g))));
          store16_as(o + i, mul(round16_as<T>(silu), load16_as_float(up + i)));
        }
#endif
      for (; i < n; i += 8) {
        const V8 g = load_as_float(gate + i);
        const V8 silu = div(g, add(splat(1.f), exp(sub(splat(0.f), g))));
        // rounded to the model dtype after silu, as the reference's two ops do
        store_as(o + i, mul(round_as<T>(silu), load_as_float(up + i)));
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x, bool native) {
  const int64_t n = out.size(-1);
  TORCH_CHECK(n % 8 == 0, "silu_and_mul: the width must be a multiple of 8");
  silu_and_mul_rows(out.data_ptr<T>(), x.data_ptr<T>(), out.numel() / n, n, native);
}

// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over rows [T, heads, D] with any token stride
template <typename T>
void rotate(T* x, int64_t token_stride, int64_t heads, int64_t D, const float* cos, const float* sin, int64_t t,
            bool native) {
  const int64_t half = D / 2;
  const float* c = cos + t * half;
  const float* s = sin + t * half;
  for (int64_t h = 0; h < heads; ++h) {
    T* row = x + t * token_stride + h * D;
    int64_t i = 0;
#ifdef ATOM_ELEMENTWISE_AVX512
    if constexpr (WIDE<T>) if (native)
      for (; i + 16 <= half; i += 16) {
        const V16 x1 = load16_as_float(row + i), x2 = load16_as_float(row + i + half);
        const V16 ci = {_mm512_loadu_ps(c + i)}, si = {_mm512_loadu_ps(s + i)};
        store16_as(row + i, sub(mul(x1, ci), mul(x2, si)));
        store16_as(row + i + half, add(mul(x2, ci), mul(x1, si)));
      }
#endif
    const int64_t done = i;
#pragma omp simd
    for (int64_t j = done; j < half; ++j) {
      const float x1 = float(row[j]), x2 = float(row[j + half]);
      // two products, then the sum, each rounded: the reference's q*cos + rotate_half(q)*sin
      const float a1 = x1 * c[j], b1 = x2 * s[j], a2 = x2 * c[j], b2 = x1 * s[j];
      row[j] = T(a1 - b1);
      row[j + half] = T(a2 + b2);
    }
  }
}

template <typename T>
void rotary_rows(T* qp, int64_t q_stride, int64_t q_heads, T* kp, int64_t k_stride, int64_t k_heads, int64_t tokens,
                 int64_t D, const float* c, const float* s, bool native) {
  at::parallel_for(0, tokens, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      rotate(qp, q_stride, q_heads, D, c, s, t, native);
      rotate(kp, k_stride, k_heads, D, c, s, t, native);
    }
  });
}

template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, bool native) {
  rotary_rows(q.data_ptr<T>(), q.stride(0), q.size(1), k.data_ptr<T>(), k.stride(0), k.size(1), q.size(0), q.size(2),
              cos.data_ptr<float>(), sin.data_ptr<float>(), native);
}

template <typename T>
struct RmsNorm {
  static void run(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps, bool native) {
    rms_norm_impl<T>(out, x, w, eps, native);
  }
};
template <typename T>
struct AddRmsNorm {
  static void run(at::Tensor& x, at::Tensor& r, const at::Tensor& w, double eps, bool native) {
    add_rms_norm_impl<T>(x, r, w, eps, native);
  }
};
template <typename T>
struct SiluAndMul {
  static void run(at::Tensor& out, const at::Tensor& x, bool native) { silu_and_mul_impl<T>(out, x, native); }
};
template <typename T>
struct Rotary {
  static void run(at::Tensor& q, at::Tensor& k, const at::Tensor& c, const at::Tensor& s, bool native) {
    rotary_impl<T>(q, k, c, s, native);
  }
};

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, ": tensors must be contiguous");
}

}  // namespace

namespace atom::op {

void gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "gemv: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "gemv: tensors must be contiguous");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.size(1) % 8 == 0 && x.size(0) >= 1,
              "gemv: x must be [M >= 1, K] with K a multiple of 8 and K = W's width");
  atom::gemv_f32(out.data_ptr<float>(), x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), w.size(0),
                 b.has_value() ? b->data_ptr<float>() : nullptr);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps, bool native) {
  check_rows(x, "rms_norm"), check_rows(out, "rms_norm"), check_rows(w, "rms_norm");
  dispatch<RmsNorm>(x.scalar_type(), "rms_norm", out, x, w, eps, native);
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps, bool native) {
  check_rows(x, "add_rms_norm"), check_rows(residual, "add_rms_norm"), check_rows(w, "add_rms_norm");
  dispatch<AddRmsNorm>(x.scalar_type(), "add_rms_norm", x, residual, w, eps, native);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x, bool native) {
  check_rows(x, "silu_and_mul"), check_rows(out, "silu_and_mul");
  TORCH_CHECK(x.size(-1) == 2 * out.size(-1), "silu_and_mul: x must be twice as wide as out");
  dispatch<SiluAndMul>(x.scalar_type(), "silu_and_mul", out, x, native);
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, bool native) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "rotary_embedding: heads of q and k must be contiguous rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(-1) * 2 == q.size(2),
              "rotary_embedding: cos and sin must be contiguous float32 [T, head_dim / 2]");
  dispatch<Rotary>(q.scalar_type(), "rotary_embedding", q, k, cos, sin, native);
}

// k, v [T, kv_heads, head_dim] (each token's heads contiguous, any token stride: the qkv buffer's
// views) into rows slots[t] of the caches [slots, kv_heads, head_dim]: what two index_copy_
// calls do, in one call and a copy of a row each (SmolLM2's shape, bfloat16, on the Xeon: 1.8 against
// 6.1 us a layer for 16 decodes, 79 against 319 us for a 2,048-token chunk). fp8 caches
// (kv_cache_dtype) take float32 or bfloat16 rows, each value converted (store_kv_row).
void store_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: the caches must be contiguous [slots, kv_heads, head_dim] of one shape and dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1,
              "store_kv: slot_mapping must be contiguous int64 [T]");
  const int64_t T = slot_mapping.size(0), S = k_cache.size(0), KVH = k_cache.size(1), D = k_cache.size(2);
  const auto cache = k_cache.scalar_type(), type = k.scalar_type();
  const bool fp8 = cache == at::kFloat8_e5m2 || cache == at::kFloat8_e4m3fn;
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == KVH && t->size(2) == D && t->stride(2) == 1 &&
                    t->stride(1) == D && t->scalar_type() == type,
                "store_kv: k and v must be [T, kv_heads, head_dim] of one dtype, each token's heads contiguous");
  TORCH_CHECK(type == cache || (fp8 && (type == at::kFloat || type == at::kBFloat16)),
              "store_kv: k and v must be of the caches' dtype, or float32 or bfloat16 into fp8 caches, not ", type,
              " into ", cache);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "store_kv: slot ", slots[t], " is out of the cache");
  const int64_t elem = k.element_size(), cache_row = KVH * D * k_cache.element_size(), n = KVH * D;
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * elem, v_stride = v.stride(0) * elem;
  at::parallel_for(0, T, fp8 ? 16 : 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (type == at::kFloat) {
        store_kv_row(kc + slots[t] * cache_row, cache, reinterpret_cast<const float*>(kp + t * k_stride), n);
        store_kv_row(vc + slots[t] * cache_row, cache, reinterpret_cast<const float*>(vp + t * v_stride), n);
      } else if (type == at::kBFloat16) {
        store_kv_row(kc + slots[t] * cache_row, cache, reinterpret_cast<const c10::BFloat16*>(kp + t * k_stride), n);
        store_kv_row(vc + slots[t] * cache_row, cache, reinterpret_cast<const c10::BFloat16*>(vp + t * v_stride), n);
      } else {
        std::memcpy(kc + slots[t] * cache_row, kp + t * k_stride, cache_row);
        std::memcpy(vc + slots[t] * cache_row, vp + t * v_stride, cache_row);
      }
    }
  });
}

}  // namespace atom::op

namespace atom {

void rms_norm_f32(float* out, const float* x, const float* w, int64_t rows, int64_t n, float eps, bool native) {
  rms_norm_rows(out, x, w, rows, n, eps, native);
}

void add_rms_norm_f32(float* x, float* residual, const float* w, int64_t rows, int64_t n, float eps, bool native) {
  add_rms_norm_rows(x, residual, w, rows, n, eps, native);
}

void silu_and_mul_f32(float* out, const float* x, int64_t rows, int64_t n, bool native) {
  silu_and_mul_rows(out, x, rows, n, native);
}

void rotary_f32(float* q, int64_t q_stride, int64_t q_heads, float* k, int64_t k_stride, int64_t k_heads,
                int64_t tokens, int64_t D, const float* cos, const float* sin, bool native) {
  rotary_rows(q, q_stride, q_heads, k, k_stride, k_heads, tokens, D, cos, sin, native);
}

void rms_norm_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w, int64_t rows, int64_t n,
                   float eps, bool native) {
  rms_norm_rows(out, x, w, rows, n, eps, native);
}

void add_rms_norm_bf16(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w, int64_t rows, int64_t n,
                       float eps, bool native) {
  add_rms_norm_rows(x, residual, w, rows, n, eps, native);
}

void silu_and_mul_bf16(c10::BFloat16* out, const c10::BFloat16* x, int64_t rows, int64_t n, bool native) {
  silu_and_mul_rows(out, x, rows, n, native);
}

void rotary_bf16(c10::BFloat16* q, int64_t q_stride, int64_t q_heads, c10::BFloat16* k, int64_t k_stride,
                 int64_t k_heads, int64_t tokens, int64_t D, const float* cos, const float* sin, bool native) {
  rotary_rows(q, q_stride, q_heads, k, k_stride, k_heads, tokens, D, cos, sin, native);
}

void gemv_f32(float* out, const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias) {
  gemm::gemm(out, x, M, K, w, N, bias);
}

#if defined(__AVX2__) && defined(__FMA__)
// eight floats as fp8 type C, as to_fp8 gives them: saturated, then c10's conversion (round to
// nearest even through the mantissa's low bits, subnormals by adding a magic float), lane by lane
template <typename C>
inline void to_fp8_x8(C* dst, __m256 x) {
  constexpr bool e5m2 = std::is_same_v<C, c10::Float8_e5m2>;
  constexpr float top = e5m2 ? 57344.f : 448.f;
  constexpr int shift = e5m2 ? 21 : 20;  // 23 less the format's mantissa bits
  constexpr int max_bits = e5m2 ? 143 << 23 : 1087 << 20, min_normal = e5m2 ? 113 << 23 : 121 << 23;
  constexpr int denorm = e5m2 ? 134 << 23 : 141 << 23;
  constexpr int rebias = e5m2 ? ((15 - 127) << 23) + 0xFFFFF : ((7 - 127) << 23) + 0x7FFFF;
  x = _mm256_min_ps(_mm256_set1_ps(top), _mm256_max_ps(_mm256_set1_ps(-top), x));  // NaN stays (second operand)
  __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(int(0x80000000u)));
  bits = _mm256_xor_si256(bits, sign);
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(rebias)),
                       _mm256_and_si256(_mm256_srli_epi32(bits, shift), _mm256_set1_epi32(1))),
      shift);
  const __m256i subnormal = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(_mm256_set1_epi32(denorm)))),
      _mm256_set1_epi32(denorm));
  __m256i r = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(min_normal), bits));
  const __m256i nan = _mm256_cmpgt_epi32(bits, _mm256_set1_epi32(max_bits - 1));  // only NaN gets here
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), nan);
  r = _mm256_and_si256(_mm256_or_si256(r, _mm256_srli_epi32(sign, 24)), _mm256_set1_epi32(0xFF));
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
}
#endif

template <typename C, typename S>
static void quantize_row(C* dst, const S* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) to_fp8_x8(dst + i, load_as_float(src + i).v);
#endif
  for (; i < n; ++i) dst[i] = to_fp8<C>(float(src[i]));
}

template <typename S>
void store_kv_row(void* dst, at::ScalarType cache, const S* src, int64_t n) {
  if (cache == at::kFloat8_e5m2)
    quantize_row(static_cast<c10::Float8_e5m2*>(dst), src, n);
  else if (cache == at::kFloat8_e4m3fn)
    quantize_row(static_cast<c10::Float8_e4m3fn*>(dst), src, n);
  else
    std::memcpy(dst, src, n * sizeof(S));
}

template void store_kv_row<float>(void*, at::ScalarType, const float*, int64_t);
template void store_kv_row<c10::BFloat16>(void*, at::ScalarType, const c10::BFloat16*, int64_t);

}  // namespace atom
