// Eight floats at a time: AVX2 + FMA where the compiler targets them (the
// build uses -march=native), plain loops elsewhere. Shared by the kernels.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// the elementwise ops' sixteen-lane variant (ops.cpp), reported by native_kernels (registry.cpp)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ATOM_ELEMENTWISE_AVX512 1
#endif
// the bfloat16 variants: pair dot products (attention_avx512_bf16.h), and the AMX tiles (attention_amx.h, gemm.cpp)
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ATOM_AVX512_BF16 1
#endif
#if defined(ATOM_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ATOM_AMX_BF16 1
#endif

namespace atom {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp's constants (Cephes), for every vector width: the clamp, log2(e), ln(2) in two parts,
// the degree-5 polynomial from the highest term down
constexpr float EXP_MAX = 88.3762626647949f, EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                               4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

// Eight floats: AVX2 where the compiler targets it, plain loops elsewhere.
#if defined(__AVX2__) && defined(__FMA__)
struct V8 {
  __m256 v;
};
inline V8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 splat(float x) { return {_mm256_set1_ps(x)}; }
inline V8 fma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 mul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 div(V8 a, V8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline V8 sub(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V8 max(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline V8 add(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline float hmax(V8 a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}
inline float hsum(V8 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}
// keys j >= n are masked out
inline V8 mask_from(V8 a, int first_masked_lane) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps(float(first_masked_lane)), _CMP_LT_OQ);
  return {_mm256_blendv_ps(_mm256_set1_ps(NEG_INF), a.v, keep)};
}
// keys j < first_kept_lane are masked out
inline V8 mask_below(V8 a, int first_kept_lane) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps(float(first_kept_lane)), _CMP_GE_OQ);
  return {_mm256_blendv_ps(_mm256_set1_ps(NEG_INF), a.v, keep)};
}
// exp: Cephes' range reduction and degree-5 polynomial (about 1 ulp); 0 below -88
inline V8 exp(V8 a) {
  __m256 x = a.v;
  const __m256 lo = _mm256_set1_ps(-EXP_MAX);
  __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_MAX)), lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2_HI), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2_LO), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[i]));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return {_mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))};
}
template <typename T>
inline V8 load_as_float(const T* p);
template <>
inline V8 load_as_float(const float* p) { return load(p); }
template <>
inline V8 load_as_float(const c10::BFloat16* p) {
  __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16))};
}
template <>
inline V8 load_as_float(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
// The fp8 KV cache's elements (kv_cache_dtype) as float16 bits, exactly: e5m2 is float16's top
// byte; e4m3fn's exponent and mantissa placed in float16's (bias 15 against 7) give its value / 256
// (subnormals too: both formats' subnormals scale alike), FP8_E4M3_UNIT is the 256.
constexpr float FP8_E4M3_UNIT = 256.f;
inline __m128i fp8_half_bits(__m128i words, const c10::Float8_e5m2*) { return _mm_slli_epi16(words, 8); }
inline __m128i fp8_half_bits(__m128i words, const c10::Float8_e4m3fn*) {
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(words, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(words, _mm_set1_epi16(0x7F)), 7));
}
template <>
inline V8 load_as_float(const c10::Float8_e5m2* p) {
  const __m128i words = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(fp8_half_bits(words, p))};
}
template <>
inline V8 load_as_float(const c10::Float8_e4m3fn* p) {
  const __m128i words = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_mul_ps(_mm256_cvtph_ps(fp8_half_bits(words, p)), _mm256_set1_ps(FP8_E4M3_UNIT))};
}
// dst[d][j] = src row j, column d (8 rows of 8 from src, stride ld) as float
template <typename T>
inline void transpose8(const T* src, int64_t ld, int n, float* dst, int ldd) {
  __m256 r[8];
  for (int j = 0; j < 8; ++j) r[j] = j < n ? load_as_float(src + j * ld).v : _mm256_setzero_ps();
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#else
struct V8 {
  float v[8];
};
inline V8 load(const float* p) { V8 a; for (int i = 0; i < 8; ++i) a.v[i] = p[i]; return a; }
inline void store(float* p, V8 a) { for (int i = 0; i < 8; ++i) p[i] = a.v[i]; }
inline V8 splat(float x) { V8 a; for (int i = 0; i < 8; ++i) a.v[i] = x; return a; }
inline V8 fma(V8 a, V8 b, V8 c) { for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline V8 mul(V8 a, V8 b) { for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i]; return a; }
inline V8 div(V8 a, V8 b) { for (int i = 0; i < 8; ++i) a.v[i] /= b.v[i]; return a; }
inline V8 sub(V8 a, V8 b) { for (int i = 0; i < 8; ++i) a.v[i] -= b.v[i]; return a; }
inline V8 max(V8 a, V8 b) { for (int i = 0; i < 8; ++i) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
inline V8 add(V8 a, V8 b) { for (int i = 0; i < 8; ++i) a.v[i] += b.v[i]; return a; }
inline float hmax(V8 a) { float m = a.v[0]; for (int i = 1; i < 8; ++i) m = std::max(m, a.v[i]); return m; }
inline float hsum(V8 a) { float s = 0.f; for (int i = 0; i < 8; ++i) s += a.v[i]; return s; }
inline V8 mask_from(V8 a, int first) { for (int i = std::max(first, 0); i < 8; ++i) a.v[i] = NEG_INF; return a; }
inline V8 mask_below(V8 a, int first) { for (int i = 0; i < std::min(first, 8); ++i) a.v[i] = NEG_INF; return a; }
inline V8 exp(V8 a) { for (int i = 0; i < 8; ++i) a.v[i] = std::exp(a.v[i]); return a; }
template <typename T>
inline V8 load_as_float(const T* p) { V8 a; for (int i = 0; i < 8; ++i) a.v[i] = float(p[i]); return a; }
template <typename T>
inline void transpose8(const T* src, int64_t ld, int n, float* dst, int ldd) {
  for (int j = 0; j < 8; ++j)
    for (int d = 0; d < 8; ++d) dst[d * ldd + j] = j < n ? float(src[j * ld + d]) : 0.f;
}
#endif


#if defined(__AVX2__) && defined(__FMA__)
// float -> bfloat16 bits in the low half of each lane, rounded to nearest even as c10::BFloat16 does (NaN: 0x7FC0)
inline __m256i bf16_bits(V8 a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
constexpr int HALF_ROUNDING = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// a rounded to T and back to float, in registers (what float(T(x)) gives)
template <typename T>
inline V8 round_as(V8 a) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a), 16))};
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return {_mm256_cvtph_ps(_mm256_cvtps_ph(a.v, HALF_ROUNDING))};
  } else {
    return a;
  }
}

// stores eight floats as T (round to nearest even for the 16-bit types, as T(x) does)
template <typename T>
inline void store_as(T* p, V8 a) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i r = bf16_bits(a);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.v, HALF_ROUNDING));
  } else {
    store(p, a);
  }
}
#else
template <typename T>
inline V8 round_as(V8 a) {
  for (int i = 0; i < 8; ++i) a.v[i] = float(T(a.v[i]));
  return a;
}

template <typename T>
inline void store_as(T* p, V8 a) {
  for (int i = 0; i < 8; ++i) p[i] = T(a.v[i]);
}
#endif

// the fp8 KV cache's element types (kv_cache_dtype fp8_e5m2, fp8_e4m3)
template <typename C>
constexpr bool is_fp8 = std::is_same_v<C, c10::Float8_e5m2> || std::is_same_v<C, c10::Float8_e4m3fn>;

// x as the fp8 type C: saturated to C's largest finite value (as vLLM's caches write; torch's own
// conversion gives an infinity or NaN past it), then rounded to nearest even by torch's conversion
template <typename C>
inline C to_fp8(float x) {
  constexpr float top = std::is_same_v<C, c10::Float8_e5m2> ? 57344.f : 448.f;
  return C(std::min(std::max(x, -top), top));
}

// F<T>::run(args...) for the kernels' element types: float, bfloat16, float16
template <template <typename> class F, typename... Args>
void dispatch(c10::ScalarType type, const char* name, Args&&... args) {
  switch (type) {
    case c10::kFloat: return F<float>::run(args...);
    case c10::kBFloat16: return F<c10::BFloat16>::run(args...);
    case c10::kHalf: return F<c10::Half>::run(args...);
    default: TORCH_CHECK(false, name, ": unsupported dtype ", type);
  }
}

}  // namespace atom
