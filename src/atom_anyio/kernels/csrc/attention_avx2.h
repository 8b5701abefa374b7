// The AVX2 variant of the paged attention: the portable variant (whose V8 code the build already
// compiles to AVX2) with a decode's scores taken from the keys as they lie. Included where the
// build targets AVX2 and FMA; it then serves every call the native variants do not take, so
// a call with native=false runs it too.
#pragma once

#if !(defined(__AVX2__) && defined(__FMA__))
#error "attention_avx2.h needs a build that targets AVX2 and FMA"
#endif

#include "attention_portable.h"

namespace atom::attention {

// The scores of a few rows straight from the keys as they lie (no staged transpose), for
// decodes: each key's products summed over its dims in 8 lanes, four keys at a time, then the
// keys' vectors folded into one by horizontal adds (9 shuffles and adds a row per 8 keys,
// against the 24 shuffles per 8 dims that staging 8 keys costs whatever the rows). Keys j >= n
// are not read (their scores are 0, masked by the caller).
template <int NR, typename T>
inline void scores_from_rows(const float* q, int D, const T* k, int64_t ldk, int n, V8 (*s)[2]) {
  for (int half = 0; half < 2; ++half) {
    __m256 h[NR][2];  // per four keys: [key t's dims 0-3 for t < 4 | their dims 4-7]
    for (int g = 0; g < 2; ++g) {
      __m256 a[NR][4];
      for (int r = 0; r < NR; ++r)
        for (int t = 0; t < 4; ++t) a[r][t] = _mm256_setzero_ps();
      const int key = 8 * half + 4 * g, keys = std::min(4, n - key);
      for (int d = 0; d < D && keys > 0; d += 8) {
        __m256 qv[NR];
        for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(q + r * D + d);
        for (int t = 0; t < keys; ++t) {
          const __m256 kv = load_as_float(k + (key + t) * ldk + d).v;
          for (int r = 0; r < NR; ++r) a[r][t] = _mm256_fmadd_ps(qv[r], kv, a[r][t]);
        }
      }
      for (int r = 0; r < NR; ++r)
        h[r][g] = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
    }
    for (int r = 0; r < NR; ++r)
      s[r][half].v = _mm256_add_ps(_mm256_permute2f128_ps(h[r][0], h[r][1], 0x20),
                                   _mm256_permute2f128_ps(h[r][0], h[r][1], 0x31));
  }
}

struct KeyRowScores {
  static constexpr bool FROM_KEYS = true;
  template <int NR, typename T>
  static void scores(const float* q, int D, const T* k, int64_t ldk, int n, V8 (*s)[2]) {
    scores_from_rows<NR>(q, D, k, ldk, n, s);
  }
};

template <typename T, typename C = T>
using Avx2 = FloatVariant<T, C, KeyRowScores>;

}  // namespace atom::attention
