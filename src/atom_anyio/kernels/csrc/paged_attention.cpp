// Paged attention on CPU that reads the KV cache where it lies.
//
// One call serves a whole step: decodes and prefill chunks (over a cached
// prefix or not), causal, GQA. The work is split into units of
// (sequence, kv head, tile of query tokens); each unit streams its context
// block by block through the block table with an online softmax, so the
// memory read is the sum of the contexts, with no gathered or padded copy.
// When there are too few units to keep every thread busy (a few long
// decodes), each unit's keys are split into partitions whose partial
// results are merged afterwards (flash-decoding).
//
// Inner loops: a KV block is staged as float (K transposed, [D][16]) so the
// score and value micro-kernels are plain fixed-width FMA loops over rows
// held in registers; exp is vectorised with AVX2 when the compiler targets it.
// A decode's few rows a head take their scores from the keys as they lie
// instead (dot products over the dims, folded by horizontal adds).
// With AVX512-BF16 and a bfloat16 cache, keys are staged as bfloat16 pairs
// and both products are pair dot products (vdpbf16ps). The next chunks are
// prefetched in pieces between the current chunk's work (struct Ahead).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "vec.h"

namespace {

using namespace atom;

constexpr int KW = 16;  // keys per chunk: two 8-float vectors
constexpr int RB = 6;   // rows per register block (12 accumulators)
constexpr int PREFETCH_CHUNKS = 4;  // how far ahead the next chunks are fetched into L2

// The next chunks' keys and values, fetched into L2 ahead of their use: blocks are scattered, so
// the hardware prefetcher cannot know where the next one is. The lines are issued a few at a time
// between pieces of the current chunk's work, each head's share in four pieces: issued as one
// burst per chunk, two chunks ahead, they stalled the core (16 decodes at 8k of context, bfloat16,
// on a Zen 5: 8.7-9.3 GB/s read that way, 21-24 GB/s spread four chunks ahead).
struct Ahead {
  const char* p = nullptr;
  int64_t left = 0;  // bytes not yet issued
  inline void issue(int64_t bytes) {
    for (; bytes > 0 && left > 0; bytes -= 64, left -= 64, p += 64) __builtin_prefetch(p, 0, 2);
  }
};

// kt[d][j] = key j of the chunk, as float; keys j >= n are zero
template <typename T>
inline void stage_keys(const T* k, int64_t ld, int n, int D, float* kt) {
  for (int d = 0; d < D; d += 8) {
    transpose8(k + d, ld, n, kt + d * KW, KW);
    transpose8(k + 8 * ld + d, ld, n - 8, kt + d * KW + 8, KW);
  }
}

// Few rows (decodes) leave too few independent FMA chains to hide their latency, so rows under
// RB / 2 keep a second set of accumulators (even and odd steps) and add them at the end. Fixed
// (batch-invariant) calls keep one set whatever the rows, so a row's sums never depend on how
// many rows share its block.
template <int NR, bool Fixed>
constexpr int num_sets = !Fixed && NR <= RB / 2 ? 2 : 1;

// s[r] = q[r] . k[j] for NR rows and the chunk's KW keys
template <int NR, bool Fixed>
inline void scores(const float* q, int D, const float* kt, V8 (*s)[2]) {
  constexpr int A = num_sets<NR, Fixed>;
  V8 acc[A][NR][2];
  for (int a = 0; a < A; ++a)
    for (int r = 0; r < NR; ++r) acc[a][r][0] = acc[a][r][1] = splat(0.f);
  for (int d = 0; d < D; d += A)
    for (int a = 0; a < A; ++a) {
      const V8 k0 = load(kt + (d + a) * KW), k1 = load(kt + (d + a) * KW + 8);
      for (int r = 0; r < NR; ++r) {
        const V8 qv = splat(q[r * D + d + a]);
        acc[a][r][0] = fma(qv, k0, acc[a][r][0]);
        acc[a][r][1] = fma(qv, k1, acc[a][r][1]);
      }
    }
  for (int r = 0; r < NR; ++r) {
    s[r][0] = acc[0][r][0], s[r][1] = acc[0][r][1];
    if constexpr (A == 2) s[r][0] = add(s[r][0], acc[1][r][0]), s[r][1] = add(s[r][1], acc[1][r][1]);
  }
}

// o[r] += sum_j p[r][j] v[j] for NR rows over n keys (p is zero past n)
template <int NR, bool Fixed>
inline void values(const float* p, const float* v, int64_t ldv, int n, int D, float* o) {
  constexpr int A = num_sets<NR, Fixed>;
  const int n_even = n & ~(A - 1);
  for (int d0 = 0; d0 < D; d0 += KW) {
    V8 acc[A][NR][2];
    for (int r = 0; r < NR; ++r) {
      acc[0][r][0] = load(o + r * D + d0), acc[0][r][1] = load(o + r * D + d0 + 8);
      if constexpr (A == 2) acc[1][r][0] = acc[1][r][1] = splat(0.f);
    }
    for (int j = 0; j < n_even; j += A)
      for (int a = 0; a < A; ++a) {
        const V8 v0 = load(v + (j + a) * ldv + d0), v1 = load(v + (j + a) * ldv + d0 + 8);
        for (int r = 0; r < NR; ++r) {
          const V8 pv = splat(p[r * KW + j + a]);
          acc[a][r][0] = fma(pv, v0, acc[a][r][0]);
          acc[a][r][1] = fma(pv, v1, acc[a][r][1]);
        }
      }
    for (int j = n_even; j < n; ++j) {
      const V8 v0 = load(v + j * ldv + d0), v1 = load(v + j * ldv + d0 + 8);
      for (int r = 0; r < NR; ++r) {
        const V8 pv = splat(p[r * KW + j]);
        acc[0][r][0] = fma(pv, v0, acc[0][r][0]);
        acc[0][r][1] = fma(pv, v1, acc[0][r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      if constexpr (A == 2) acc[0][r][0] = add(acc[0][r][0], acc[1][r][0]), acc[0][r][1] = add(acc[0][r][1], acc[1][r][1]);
      store(o + r * D + d0, acc[0][r][0]), store(o + r * D + d0 + 8, acc[0][r][1]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
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
constexpr bool SCORES_FROM_KEYS = true;
#else
constexpr bool SCORES_FROM_KEYS = false;  // a build without AVX2 always stages
#endif

// rows at or under this many per kv head take their scores from the keys as they lie (decodes;
// never a batch-invariant call, whose sums must not depend on the rows a block holds)
constexpr int ROWS_FROM_KEYS_MAX = 3;

// one chunk of keys [key0, key0 + n) for NR rows: scores, online softmax, values. kt: the chunk's
// keys staged transposed, or null to take the scores from the keys k as they lie
template <int NR, bool Fixed, typename T = float>
inline void rows_chunk(const float* q, int D, const float* kt, const T* k, int64_t ldk, const float* v, int64_t ldv,
                       int n, const int* qpos, int key0, int window, float* m, float* l, float* o) {
  V8 s[NR][2];
  float p[NR * KW];
#if defined(__AVX2__) && defined(__FMA__)
  if (!kt)
    scores_from_rows<NR>(q, D, k, ldk, n, s);
  else
#endif
    scores<NR, Fixed>(q, D, kt, s);
  for (int r = 0; r < NR; ++r) {
    const int visible = std::min(n, qpos[r] - key0 + 1);  // causal: keys up to the row's own position
    V8 s0 = s[r][0], s1 = s[r][1];
    if (visible < KW) s0 = mask_from(s0, visible), s1 = mask_from(s1, visible - 8);
    if (window > 0) {  // sliding window: keys after the row's position - window
      const int first = qpos[r] - window + 1 - key0;
      s0 = mask_below(s0, first), s1 = mask_below(s1, first - 8);
    }
    const float mx = std::max(m[r], hmax(max(s0, s1)));
    if (mx == NEG_INF) {  // nothing visible yet for this row
      store(p + r * KW, splat(0.f)), store(p + r * KW + 8, splat(0.f));
      continue;
    }
    const V8 e0 = exp(sub(s0, splat(mx))), e1 = exp(sub(s1, splat(mx)));
    store(p + r * KW, e0), store(p + r * KW + 8, e1);
    // the max unchanged (most chunks once a row has seen a few): exp(0), without the call
    const float alpha = m[r] == mx ? 1.f : m[r] == NEG_INF ? 0.f : std::exp(m[r] - mx);
    l[r] = l[r] * alpha + hsum(add(e0, e1));
    m[r] = mx;
    if (alpha != 1.f)
      for (int d = 0; d < D; d += 8) store(o + r * D + d, mul(load(o + r * D + d), splat(alpha)));
  }
  values<NR, Fixed>(p, v, ldv, n, D, o);
}

template <bool Fixed, int NR = RB, typename T = float>
inline void rows_dispatch(int rows, const float* q, int D, const float* kt, const T* k, int64_t ldk, const float* v,
                          int64_t ldv, int n, const int* qpos, int key0, int window, float* m, float* l, float* o) {
  if constexpr (NR > 0) {
    if (!kt && NR > ROWS_FROM_KEYS_MAX) {
      rows_dispatch<Fixed, ROWS_FROM_KEYS_MAX>(rows, q, D, kt, k, ldk, v, ldv, n, qpos, key0, window, m, l, o);
      return;
    }
    if (rows >= NR) {
      rows_chunk<NR, Fixed>(q, D, kt, k, ldk, v, ldv, n, qpos, key0, window, m, l, o);
      rows_dispatch<Fixed, NR>(rows - NR, q + NR * D, D, kt, k, ldk, v, ldv, n, qpos + NR, key0, window, m + NR,
                               l + NR, o + NR * D);
    } else {
      rows_dispatch<Fixed, NR - 1>(rows, q, D, kt, k, ldk, v, ldv, n, qpos, key0, window, m, l, o);
    }
  }
}

#ifdef ATOM_AVX512_BF16
// The AVX512-BF16 variant for bfloat16 caches: scores as bfloat16 pair dot products
// (vdpbf16ps: products exact, sums in float32) over keys transposed as pairs, and values
// read as bfloat16 into 16-float FMAs, in place of staging every key and value as float.
constexpr int NB = 6;  // rows per register block

// rows r[0..15] of 16 dwords -> columns (a 16 x 16 transpose)
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c]: rows 4g..4g+3 of columns c, c + 4, c + 8, c + 12 (one per 128-bit lane)
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g + 0], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g + 0], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88), r[c + 4] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[c + 8] = _mm512_shuffle_i32x4(v1, v3, 0x88), r[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// kp[p * 16 + j] = dims 2p, 2p + 1 of key j as one dword, for the chunk's n keys (zero past n)
inline void stage_key_pairs(const c10::BFloat16* k, int64_t ld, int n, int P, uint32_t* kp) {
  for (int p0 = 0; p0 < P; p0 += 16) {
    const __mmask16 cols = P - p0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (P - p0)) - 1);
    __m512i r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < n ? _mm512_maskz_loadu_epi32(cols, reinterpret_cast<const uint32_t*>(k + j * ld) + p0)
                   : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16 && p0 + p < P; ++p) _mm512_storeu_si512(kp + (p0 + p) * 16, r[p]);
  }
}

// exp as exp() in vec.h (its constants), 16 lanes; 0 below -88
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-EXP_MAX);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_MAX)), lo);
  const __m512 fx =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_HI), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_LO), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[i]));
  y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(__mmask16(~tiny), y, _mm512_castsi512_ps(e));
}

// Where the values' accumulators keep output dim d: each 32 dims are two 16-float registers, the
// pairs that _mm512_unpacklo_epi16 and _mm512_unpackhi_epi16 of two keys' rows give: per 128-bit
// lane L, dims 8L..8L+3 in the first and 8L+4..8L+7 in the second (a last block of 16 dims: two
// 8-float halves). o stays in this order while a unit's keys stream; unpermute_rows puts it back.
inline int bf16_slot_of_dim(int d, int D) {
  const int c = d % 32, block = d - c, half = std::min(32, D - block) / 2, lane = c / 8, e = c % 8;
  return block + (e < 4 ? 4 * lane + e : half + 4 * lane + e - 4);
}

inline void unpermute_rows(float* o, int rows, int D, float* tmp) {
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < D; ++d) tmp[d] = o[r * D + bf16_slot_of_dim(d, D)];
    std::memcpy(o + r * D, tmp, D * sizeof(float));
  }
}

// one chunk of n keys for NR rows: scores, online softmax, values (q as bf16 pairs, unscaled).
// Scores are bfloat16 pair dot products over the dims (two accumulators per row, even and odd
// pairs, for more independent chains); values are pair dot products over two keys at a time, the
// probabilities rounded to bfloat16 as FlashAttention rounds P before P.V (the normaliser l sums
// them unrounded). Each row's sums are in one fixed order whatever NR is.
template <int NR>
inline void bf16_scores_from_pairs(const uint32_t* q, int P, const uint32_t* kp, __m512* s) {
  __m512 s2[NR];
  for (int r = 0; r < NR; ++r) s[r] = s2[r] = _mm512_setzero_ps();
  for (int p = 0; p < P; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * 16), k1 = (__m512bh)_mm512_loadu_si512(kp + p * 16 + 16);
    for (int r = 0; r < NR; ++r) {
      s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(q[r * P + p]), k0);
      s2[r] = _mm512_dpbf16_ps(s2[r], (__m512bh)_mm512_set1_epi32(q[r * P + p + 1]), k1);
    }
  }
  for (int r = 0; r < NR; ++r) s[r] = _mm512_add_ps(s[r], s2[r]);
}

// The scores of a few rows straight from the keys as they lie (no staged transpose): each key's
// products summed over its dims in 16 lanes, then the 16 keys' vectors folded into one by a
// reduction tree (30 shuffles and 15 adds a row, against the 96 shuffles per 32 dims that staging
// the keys as pairs costs whatever the rows). Input vector i of the tree lands in lane
// 4 (i % 4) + i / 4, so vector i is fed key 4 (i % 4) + i / 4 and lane j ends up key j.
template <int NR>
inline void bf16_scores_from_rows(const c10::BFloat16* q, int D, const c10::BFloat16* k, int64_t ldk, int n,
                                  __m512* s) {
  __m512 d[NR][2];
  for (int h = 0; h < 2; ++h) {
    __m512 c[NR][2];
    for (int g = 0; g < 2; ++g) {
      __m512 a[NR][4];
      for (int r = 0; r < NR; ++r)
        for (int t = 0; t < 4; ++t) a[r][t] = _mm512_setzero_ps();
      for (int dim = 0; dim < D; dim += 32) {
        const __mmask32 dims = D - dim >= 32 ? __mmask32(0xFFFFFFFF) : __mmask32(0xFFFF);
        for (int t = 0; t < 4; ++t) {
          const int i = 8 * h + 4 * g + t, key = 4 * (i % 4) + i / 4;
          if (key >= n) continue;  // a zero vector: its lane is masked afterwards
          const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(dims, k + key * ldk + dim);
          for (int r = 0; r < NR; ++r)
            a[r][t] = _mm512_dpbf16_ps(a[r][t], (__m512bh)_mm512_maskz_loadu_epi16(dims, q + r * D + dim), kv);
        }
      }
      for (int r = 0; r < NR; ++r) {
        const __m512 b0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[r][0], a[r][1], 0x44),
                                        _mm512_shuffle_f32x4(a[r][0], a[r][1], 0xEE));
        const __m512 b1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[r][2], a[r][3], 0x44),
                                        _mm512_shuffle_f32x4(a[r][2], a[r][3], 0xEE));
        c[r][g] = _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, 0x88), _mm512_shuffle_f32x4(b0, b1, 0xDD));
      }
    }
    for (int r = 0; r < NR; ++r)
      d[r][h] = _mm512_add_ps(_mm512_shuffle_ps(c[r][0], c[r][1], 0x44), _mm512_shuffle_ps(c[r][0], c[r][1], 0xEE));
  }
  for (int r = 0; r < NR; ++r)
    s[r] = _mm512_add_ps(_mm512_shuffle_ps(d[r][0], d[r][1], 0x88), _mm512_shuffle_ps(d[r][0], d[r][1], 0xDD));
}

// rows at or under this many per kv head take their scores from the keys as they lie
constexpr int ROW_SCORES_MAX = 4;

// The online softmax's step for NR rows over a chunk's n scores s (unscaled): each row's masked,
// scaled scores, its running max m and sum l updated, its probabilities as bfloat16 into pb
// (row r: pb[16 r .. 16 r + 15], zero past the visible keys) and the factor its output so far is
// to be scaled by (1: unchanged).
template <int NR>
inline void bf16_softmax(const __m512* s, int n, const int* qpos, int key0, int window, float scale, float* m,
                         float* l, uint16_t* pb, float* alpha) {
  for (int r = 0; r < NR; ++r) {
    alpha[r] = 1.f;
    const int visible = std::min(n, qpos[r] - key0 + 1);  // causal: keys up to the row's own position
    __mmask16 keep = visible <= 0 ? 0 : visible >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << visible) - 1);
    if (window > 0) {  // sliding window: keys after the row's position - window
      const int first = qpos[r] - window + 1 - key0;
      if (first > 0) keep &= first >= 16 ? 0 : __mmask16(~((1u << first) - 1));
    }
    const __m512 sr = _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), keep, s[r], _mm512_set1_ps(scale));
    const float mx = std::max(m[r], _mm512_reduce_max_ps(sr));
    if (mx == NEG_INF) {  // nothing visible yet for this row
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 16), _mm256_setzero_si256());
      continue;
    }
    const __m512 e = exp16(_mm512_sub_ps(sr, _mm512_set1_ps(mx)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 16), (__m256i)_mm512_cvtneps_pbh(e));
    alpha[r] = m[r] == mx ? 1.f : m[r] == NEG_INF ? 0.f : std::exp(m[r] - mx);  // exp(0) without the call
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(e);
    m[r] = mx;
  }
}

template <int NR>
inline void bf16_rows_chunk(const uint32_t* q, int P, const uint32_t* kp, const c10::BFloat16* k, int64_t ldk,
                            const c10::BFloat16* v, int64_t ldv, int n, const int* qpos, int key0, int window,
                            float scale, float* m, float* l, float* o) {
  const int D = 2 * P;
  __m512 s[NR];
  if (kp)
    bf16_scores_from_pairs<NR>(q, P, kp, s);
  else
    bf16_scores_from_rows<NR>(reinterpret_cast<const c10::BFloat16*>(q), D, k, ldk, n, s);
  alignas(64) uint16_t pb[NR * 16];  // the probabilities as bfloat16, two keys per dword
  float alpha[NR];
  bf16_softmax<NR>(s, n, qpos, key0, window, scale, m, l, pb, alpha);
  for (int r = 0; r < NR; ++r)
    if (alpha[r] != 1.f)
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), _mm512_set1_ps(alpha[r])));
  const uint32_t* pp = reinterpret_cast<const uint32_t*>(pb);  // row r, keys 2i and 2i + 1: pp[r * 8 + i]
  for (int d = 0; d < D; d += 32) {
    // 32 dims, or a last 16 (the upper half of each register zero: half the lanes of lo and hi)
    const int half = std::min(32, D - d) / 2;
    const __mmask32 dims = half == 16 ? __mmask32(0xFFFFFFFF) : __mmask32(0xFFFF);
    const __mmask16 lanes = half == 16 ? __mmask16(0xFFFF) : __mmask16(0xFF);
    __m512 lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r)
      lo[r] = _mm512_maskz_loadu_ps(lanes, o + r * D + d), hi[r] = _mm512_maskz_loadu_ps(lanes, o + r * D + d + half);
    for (int j = 0; j < n; j += 2) {
      const __m512i a = _mm512_maskz_loadu_epi16(dims, v + j * ldv + d);
      const __m512i b = j + 1 < n ? _mm512_maskz_loadu_epi16(dims, v + (j + 1) * ldv + d) : _mm512_setzero_si512();
      const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(pp[r * 8 + j / 2]);
        lo[r] = _mm512_dpbf16_ps(lo[r], pr, vlo);
        hi[r] = _mm512_dpbf16_ps(hi[r], pr, vhi);
      }
    }
    for (int r = 0; r < NR; ++r)
      _mm512_mask_storeu_ps(o + r * D + d, lanes, lo[r]), _mm512_mask_storeu_ps(o + r * D + d + half, lanes, hi[r]);
  }
}

// kp: the chunk's keys staged as pairs, or null to take the scores from the keys k as they lie
template <int NR = NB>
inline void bf16_rows_dispatch(int rows, const uint32_t* q, int P, const uint32_t* kp, const c10::BFloat16* k,
                               int64_t ldk, const c10::BFloat16* v, int64_t ldv, int n, const int* qpos, int key0,
                               int window, float scale, float* m, float* l, float* o) {
  if constexpr (NR > 0) {
    if (!kp && NR > ROW_SCORES_MAX) {
      bf16_rows_dispatch<ROW_SCORES_MAX>(rows, q, P, kp, k, ldk, v, ldv, n, qpos, key0, window, scale, m, l, o);
      return;
    }
    for (; rows >= NR; rows -= NR, q += NR * P, qpos += NR, m += NR, l += NR, o += NR * 2 * P)
      bf16_rows_chunk<NR>(q, P, kp, k, ldk, v, ldv, n, qpos, key0, window, scale, m, l, o);
    if (rows > 0) bf16_rows_dispatch<NR - 1>(rows, q, P, kp, k, ldk, v, ldv, n, qpos, key0, window, scale, m, l, o);
  }
}
#endif

// The AMX variant's shapes, outside its #ifdef: the units are cut by them on every CPU (a build
// without AMX-BF16 never takes that branch, but must compile it)
constexpr int AMX_CHUNKS = 8;  // chunks of 16 keys per softmax step
constexpr int AMX_ROWS = 64;   // a prefill unit's rows per kv head: four blocks of 16 share each key read

#ifdef ATOM_AMX_BF16
// The AMX variant for a bfloat16 cache (decodes and prefill units): both products on the tile
// unit, which does a 16 x 16 x 32 block in the time AVX-512 does a few hundred pair dot products
// (on a 2-core Xeon with AMX: 1.6 TMAC/s against 30 GMAC/s for vdpbf16ps), no key or value staged:
// - scores transposed, S^T = K Q^T: the keys, 16 of a chunk straight from the cache, are the A
//   tile (rows: keys, 32 dims a tile), the queries of the kv head as dim pairs (prepared once) B;
// - the softmax of AMX_CHUNKS chunks at once, one lane per query row, its probabilities
//   transposed to rows of 16 keys;
// - O += P V with the values straight from the cache as B (rows: keys, 16 dim pairs a row): the
//   tile unit sums over pairs (key, dim parity), so P goes in twice, as the even halves of dwords
//   (the other half zero: the even dims out) and as the odd halves (the odd dims out).
// Probabilities are rounded to bfloat16 before P.V, as in the AVX-512 variant; their sum is not.



constexpr float LOG2E = 1.44269504088896341f;

// 2^t in 16 lanes for t <= 0 (scores less their max, base 2), 0 below -126 and for -inf: a
// degree-4 polynomial on the fraction (within 4e-5 relative, where the probabilities are then
// rounded to bfloat16's 4e-3) and vscalefps for the power, 9 instructions where exp16 takes 17
inline __m512 exp2_16(__m512 t) {
  const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  t = _mm512_max_ps(t, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0096181291f), f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// The tiles' shapes for `cols` query rows a kv head (the scores' columns, the probabilities' rows)
struct AmxShapes {
  TileConfig qk, pv;
  explicit AmxShapes(int cols) {
    // scores: 0-3 keys (two chunks x two dim blocks), 4-5 queries (two dim blocks), 6-7 scores (two chunks)
    const int qk_colsb[8] = {64, 64, 64, 64, 4 * cols, 4 * cols, 4 * cols, 4 * cols};
    // values: 0-1 values (two dim blocks), 2-3 probabilities (even, odd), 4-7 outputs (dim block x parity)
    const int pv_rows[8] = {16, 16, cols, cols, cols, cols, cols, cols};
    for (int t = 0; t < 8; ++t) {
      qk.rows[t] = 16, qk.colsb[t] = qk_colsb[t];
      pv.rows[t] = pv_rows[t], pv.colsb[t] = 64;
    }
  }
};

// a thread's buffers for the AMX attention of H heads (G a kv head) of head_dim D
struct AmxScratch {
  int H, G, KVH, D;
  AmxShapes decode, prefill;         // a decode's G rows a kv head; a prefill block's 16
  std::vector<uint32_t> qt;          // [blocks][KVH][D / 32][16][cols]: the queries as dim pairs
  std::vector<float> sbuf;           // [AMX_CHUNKS * 16][lanes]: scores, keys major
  // [AMX_CHUNKS][lanes][16] and a zero row: probabilities, rows major, each as the high half of a
  // dword (bfloat16 pairs 0, p): the odd dims' A tile as it lies, the even dims' one 2 bytes on
  std::vector<uint32_t> pp;
  std::vector<float> alpha;          // [lanes]
  std::vector<int> lane_row;         // [lanes]: each lane's row of the attend arrays (-1: none)
  std::vector<int> lane_pos;         // [lanes]: each lane's query position
  std::vector<float> c4;             // [4][16][16]: a kv head's outputs, 64 dims (even, odd of 32 twice)
  std::vector<c10::BFloat16> vtail;  // [16][KVH * D]: a last partial chunk's values, zero past its keys
  AmxScratch(int H_, int KVH_, int D_)
      : H(H_), G(H_ / KVH_), KVH(KVH_), D(D_), decode(H_ / KVH_), prefill(16),
        qt(AMX_ROWS / 16 * KVH_ * D_ / 2 * 16), sbuf(AMX_CHUNKS * 16 * lanes_max(), 0.f),
        pp((AMX_CHUNKS * lanes_max() + 1) * 16, 0u), alpha(lanes_max()),
        lane_row(lanes_max()), lane_pos(lanes_max()), c4(4 * 256), vtail(16 * KVH_ * D_) {}
  int lanes_max() const { return std::max((H + 15) / 16 * 16, 16 * KVH); }
};

// whether the AMX kernel serves a step of this shape
inline bool amx_fits(int H, int KVH, int D, int BS) {
  return amx_permitted() && D % 64 == 0 && H / KVH <= 16 && BS % 16 == 0;
}

// One unit's rows (nt query tokens from position pos0, every head; token t's head j at
// q + t * H * D + j * D) over keys [key_lo, key_hi), key_lo a multiple of 16. m, l, o (rows kv
// head major, then token, then head of the group, as the caller lays them out) come as the
// caller set them (-inf, 0, 0) and leave as the running max, sum and unnormalised output.
// A decode's rows (G a kv head) share one block of lanes across the heads; a prefill unit's
// rows are cut in blocks of 16 a kv head, each block a lane block, every block taking each
// softmax step's keys while they are in L2. Tiles are not renamed: a load into a tile waits for
// the products still reading it, so each phase keeps two or four products independent (two
// chunks, two dim blocks) under its own shapes.
// `fetch_hi`: the keys the caller reads next stop there (a unit's next partition follows on this
// thread: the last step fetches its first one, and `fetched` says the call finds it so).
void amx_attend(AmxScratch& w, const c10::BFloat16* q, int nt, int pos0, const c10::BFloat16* kc,
                const c10::BFloat16* vc, int64_t slot_stride, const int* table, int BS, int key_lo, int key_hi,
                int fetch_hi, bool fetched, int window, float scale, float* m, float* l, float* o) {
  const int H = w.H, G = w.G, KVH = w.KVH, D = w.D, NDB = D / 32, group_rows = nt * G;
  const bool decode = nt == 1;
  const int cols = decode ? G : 16, blocks = decode ? 1 : (group_rows + 15) / 16;
  const int HS = (KVH * cols + 15) / 16 * 16;  // lanes of a score row
  const AmxShapes& shapes = decode ? w.decode : w.prefill;
  const int64_t ld = slot_stride * int64_t(sizeof(c10::BFloat16));  // a key's row, in bytes
  TileScope tiles;  // whoever used the tiles on this thread (oneDNN, the linears) finds its shapes back
  std::fill(w.qt.begin(), w.qt.begin() + blocks * KVH * NDB * 16 * cols, 0u);
  for (int b = 0; b < blocks; ++b)
    for (int h = 0; h < KVH; ++h)
      for (int c = 0; c < cols; ++c) {
        const int local = decode ? c : b * 16 + c;
        if (local >= group_rows) break;
        const int t = local / G, g = local % G;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(q + int64_t(t) * H * D + (h * G + g) * D);
        for (int db = 0; db < NDB; ++db)
          for (int i = 0; i < 16; ++i) w.qt[(((b * KVH + h) * NDB + db) * 16 + i) * cols + c] = src[db * 16 + i];
      }
  auto slot_of = [&](int key) { return int64_t(table[key / BS]) * BS + key % BS; };
  // The next softmax step's keys and values, fetched into L2 a few lines at a time between the
  // current step's pieces of work: at the tile unit's speed the step is bound by memory, and a
  // burst of a whole step's lines stalls the core instead of keeping its misses in flight.
  struct Stream {
    const char *k[AMX_CHUNKS], *v[AMX_CHUNKS];
    int64_t bytes[AMX_CHUNKS], off = 0;
    int nc = 0, c = 0, per_step = 0;
    inline void issue(int64_t lines) {
      for (; lines > 0 && c < nc; lines -= 2) {
        __builtin_prefetch(k[c] + off, 0, 2);
        __builtin_prefetch(v[c] + off, 0, 2);
        if ((off += 64) >= bytes[c]) ++c, off = 0;
      }
    }
    inline void step() { issue(per_step); }
  } ahead;
  auto fetch_step_from = [&](int s0, int steps) {  // the step at keys s0, spread over `steps` calls
    ahead.nc = ahead.c = 0, ahead.off = 0;
    int64_t lines = 0;
    for (int key0 = s0; key0 < fetch_hi && ahead.nc < AMX_CHUNKS; key0 += 16, ++ahead.nc) {
      const int64_t slot = slot_of(key0);
      ahead.k[ahead.nc] = reinterpret_cast<const char*>(kc + slot * slot_stride);
      ahead.v[ahead.nc] = reinterpret_cast<const char*>(vc + slot * slot_stride);
      ahead.bytes[ahead.nc] = std::min(16, fetch_hi - key0) * ld;
      lines += 2 * ((ahead.bytes[ahead.nc] + 63) / 64);
    }
    ahead.per_step = (lines + steps - 1) / steps + 1;
  };
  const __m512i even_dims = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i odd_dims = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 neg_inf = _mm512_set1_ps(NEG_INF);
  const c10::BFloat16 *kbase[AMX_CHUNKS], *vbase[AMX_CHUNKS];
  if (!fetched) {
    fetch_step_from(key_lo, 1);
    ahead.step();  // the first step's lines at once: nothing to spread them over
  }
  for (int s0 = key_lo; s0 < key_hi; s0 += AMX_CHUNKS * 16) {
    const int nc = std::min(AMX_CHUNKS, (key_hi - s0 + 15) / 16), nkeys = std::min(AMX_CHUNKS * 16, key_hi - s0);
    const int steps_a_block = KVH * ((nc + 1) / 2) + nc * (HS / 16) + KVH * (NDB / 2) * nc;
    fetch_step_from(s0 + AMX_CHUNKS * 16, blocks * steps_a_block);
    for (int c = 0; c < nc; ++c) {
      const int key0 = s0 + 16 * c, n = std::min(16, key_hi - key0);
      const int64_t slot = slot_of(key0);
      kbase[c] = kc + slot * slot_stride;  // past n: the block's other slots (masked below)
      vbase[c] = vc + slot * slot_stride;
      if (n < 16) {  // the values past the keys must be zeros, not whatever the slots hold (0 x NaN)
        std::memcpy(w.vtail.data(), vbase[c], n * ld);
        std::memset(static_cast<void*>(w.vtail.data() + n * slot_stride), 0, (16 - n) * ld);
        vbase[c] = w.vtail.data();
      }
    }
    for (int b = 0; b < blocks; ++b) {
      // scores, transposed: sbuf[key][lane], lane h * cols + c
      _tile_loadconfig(&shapes.qk);
      for (int h = 0; h < KVH; ++h)
        for (int c = 0; c < nc; c += 2) {  // two chunks (the second maybe past the keys: skipped)
          const bool pair = c + 1 < nc;
          ahead.step();
          _tile_zero(6);
          _tile_zero(7);
          for (int db = 0; db < NDB; db += 2) {
            _tile_loadd(4, &w.qt[(((b * KVH + h) * NDB + db) * 16) * cols], 4 * cols);
            _tile_loadd(5, &w.qt[(((b * KVH + h) * NDB + db + 1) * 16) * cols], 4 * cols);
            _tile_loadd(0, kbase[c] + h * D + db * 32, ld);
            _tile_loadd(1, kbase[c] + h * D + db * 32 + 32, ld);
            if (pair) {
              _tile_loadd(2, kbase[c + 1] + h * D + db * 32, ld);
              _tile_loadd(3, kbase[c + 1] + h * D + db * 32 + 32, ld);
            }
            _tile_dpbf16ps(6, 0, 4);
            if (pair) _tile_dpbf16ps(7, 2, 4);
            _tile_dpbf16ps(6, 1, 5);
            if (pair) _tile_dpbf16ps(7, 3, 5);
          }
          _tile_stored(6, &w.sbuf[(c * 16) * HS + h * cols], HS * 4);
          if (pair) _tile_stored(7, &w.sbuf[((c + 1) * 16) * HS + h * cols], HS * 4);
        }
      // each lane's row of the attend arrays and query position (past the rows: -1, a position
      // that sees nothing)
      for (int lane = 0; lane < HS; ++lane) {
        const int h = lane / cols, c = lane % cols, local = decode ? c : b * 16 + c;
        const int r = h >= KVH || local >= group_rows ? -1 : h * group_rows + local;
        w.lane_row[lane] = r;
        w.lane_pos[lane] = r < 0 ? -1 : pos0 + local / G;
      }
      // the softmax step, 16 lanes at a time; probabilities transposed into pe / po
      for (int lb = 0; lb < HS; lb += 16) {
        // The scores scaled, and -inf where a lane does not see the key (past the keys, causal,
        // window): the mask only where the step has such keys for some lane.
        const __m512i pos = _mm512_loadu_si512(&w.lane_pos[lb]);
        int lo_pos = INT32_MAX;
        for (int t = 0; t < 16; ++t)
          if (w.lane_pos[lb + t] >= 0) lo_pos = std::min(lo_pos, w.lane_pos[lb + t]);
        const int hi_pos = _mm512_reduce_max_epi32(pos);
        const bool masked = nkeys < nc * 16 || s0 + nkeys - 1 > lo_pos || (window > 0 && s0 <= hi_pos - window);
        // the lanes' running max and sum, gathered from the rows they stand for
        alignas(64) float m_lane[16], l_lane[16];
        for (int t = 0; t < 16; ++t) {
          const int r = w.lane_row[lb + t];
          m_lane[t] = r < 0 ? NEG_INF : m[r];
          l_lane[t] = r < 0 ? 0.f : l[r];
        }
        // in base 2 from here (scores scaled by log2(e)), the rows' m in natural units
        const __m512 m_old = _mm512_mul_ps(_mm512_load_ps(m_lane), _mm512_set1_ps(LOG2E));
        __m512 mx4[4] = {m_old, m_old, m_old, m_old};  // four chains: a max's latency a key otherwise
        const __m512 sc = _mm512_set1_ps(scale * LOG2E);
        for (int j = 0; j < nc * 16; ++j) {
          float* row = &w.sbuf[j * HS + lb];
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row), sc);
          if (masked) {
            const int key = s0 + j;
            __mmask16 seen = j < nkeys ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(key), pos, _MM_CMPINT_LE) : 0;
            if (window > 0) seen &= _mm512_cmp_epi32_mask(_mm512_set1_epi32(key + window), pos, _MM_CMPINT_GT);
            x = _mm512_mask_mov_ps(neg_inf, seen, x);
          }
          _mm512_storeu_ps(row, x);
          mx4[j % 4] = _mm512_max_ps(mx4[j % 4], x);
        }
        const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3]));
        const __mmask16 none = _mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ);  // nothing seen yet
        const __m512 base = _mm512_mask_mov_ps(mx, none, _mm512_setzero_ps());
        __m512 sum4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int c = 0; c < nc; ++c) {
          ahead.step();
          __m512i r[16];
          for (int j = 0; j < 16; ++j) {
            const __m512 e = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(&w.sbuf[(c * 16 + j) * HS + lb]), base));
            sum4[j % 4] = _mm512_add_ps(sum4[j % 4], e);
            r[j] = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e)), 16);
          }
          transpose16(r);  // r[t]: lane lb + t's 16 keys
          for (int t = 0; t < 16; ++t) _mm512_storeu_si512(&w.pp[(c * HS + lb + t) * 16], r[t]);
        }
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(sum4[0], sum4[1]), _mm512_add_ps(sum4[2], sum4[3]));
        const __mmask16 fresh = _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_EQ_OQ);
        _mm512_storeu_ps(&w.alpha[lb], _mm512_maskz_mov_ps(~fresh, exp2_16(_mm512_sub_ps(m_old, base))));
        _mm512_store_ps(l_lane, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(l_lane), _mm512_loadu_ps(&w.alpha[lb])), sum));
        _mm512_store_ps(m_lane, _mm512_mul_ps(mx, _mm512_set1_ps(1.f / LOG2E)));
        for (int t = 0; t < 16; ++t)
          if (const int r = w.lane_row[lb + t]; r >= 0) m[r] = m_lane[t], l[r] = l_lane[t];
      }
      // o = o * alpha + P V, a kv head and 64 dims at a time
      _tile_loadconfig(&shapes.pv);
      for (int h = 0; h < KVH; ++h)
        for (int db = 0; db < NDB; db += 2) {
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_zero(7);
          for (int c = 0; c < nc; ++c) {
            ahead.step();
            _tile_loadd(2, reinterpret_cast<const char*>(&w.pp[(c * HS + h * cols) * 16]) + 2, 64);
            _tile_loadd(3, &w.pp[(c * HS + h * cols) * 16], 64);
            _tile_loadd(0, vbase[c] + h * D + db * 32, ld);
            _tile_loadd(1, vbase[c] + h * D + db * 32 + 32, ld);
            _tile_dpbf16ps(4, 2, 0);
            _tile_dpbf16ps(5, 3, 0);
            _tile_dpbf16ps(6, 2, 1);
            _tile_dpbf16ps(7, 3, 1);
          }
          _tile_stored(4, &w.c4[0], 64);
          _tile_stored(5, &w.c4[256], 64);
          _tile_stored(6, &w.c4[512], 64);
          _tile_stored(7, &w.c4[768], 64);
          for (int c = 0; c < cols; ++c) {
            const int r = w.lane_row[h * cols + c];
            if (r < 0) break;
            const __m512 a = _mm512_set1_ps(w.alpha[h * cols + c]);
            for (int half = 0; half < 2; ++half) {
              const __m512 e = _mm512_loadu_ps(&w.c4[(2 * half) * 256 + c * 16]);
              const __m512 od = _mm512_loadu_ps(&w.c4[(2 * half + 1) * 256 + c * 16]);
              const __m512 lo = _mm512_unpacklo_ps(e, od), hi = _mm512_unpackhi_ps(e, od);
              float* dst = o + int64_t(r) * D + (db + half) * 32;
              _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), a, _mm512_permutex2var_ps(lo, even_dims, hi)));
              _mm512_storeu_ps(dst + 16,
                               _mm512_fmadd_ps(_mm512_loadu_ps(dst + 16), a, _mm512_permutex2var_ps(lo, odd_dims, hi)));
            }
          }
        }
    }
    ahead.issue(INT64_MAX);  // what the step left
  }
}
#endif

// whether the native variants run (atom::set_native_kernels turns them off, to compare with the portable twin)
bool g_native = true;
// whether bfloat16 units take the AMX variant where it is built (off: the AVX-512 one, as on a CPU without AMX)
bool g_amx = true;

struct Unit {
  int seq, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence, every head
  int key_lo, key_hi;       // the keys any of them sees: [key_lo, key_hi), key_lo at a block start
};

template <typename T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start, int64_t block_size,
         double scale, int64_t sliding_window, const float* sinks, int64_t partition) {
  const int H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH;
  const int B = seq_lens.size(0), max_blocks = block_tables.size(1), BS = block_size;
  const int* tables = block_tables.data_ptr<int>();
  const int* lens = seq_lens.data_ptr<int>();
  const int* qstart = query_start.data_ptr<int>();
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t slot_stride = int64_t(KVH) * D;

  // A unit is a tile of one sequence's query tokens with all its heads, so a chunk of KV
  // (consecutive slots, every head) is read once, in one piece. About 36 rows per kv head.
  // The AMX kernel takes every unit of a bfloat16 step where it fits, its prefill units 64 rows a
  // kv head. It is batch-invariant when the keys are split at fixed multiples (`partition`, a
  // multiple of 128): a row's products, its softmax steps of 128 keys and their lanes' sums are the
  // same in a decode and in any prefill tile, the keys a row does not see adding exact zeros.
  bool use_amx = false;
#ifdef ATOM_AMX_BF16
  use_amx = std::is_same_v<T, c10::BFloat16> && g_native && g_amx && amx_fits(H, KVH, D, BS);
#endif
  const int tile = use_amx ? std::max(1, AMX_ROWS / G) : std::max(1, 36 / G);
  const int window = int(sliding_window);  // 0: the whole causal context
  std::vector<Unit> units;
  int max_span = 0;
  for (int b = 0; b < B; ++b) {
    const int nq = qstart[b + 1] - qstart[b], first_pos = lens[b] - nq;
    for (int i = 0; i < nq; i += tile) {
      const int q_end = std::min(nq, i + tile), hi = first_pos + q_end;  // causal bound of the tile
      int lo = window > 0 ? std::max(0, first_pos + i - window + 1) / BS * BS : 0;  // chunks before: skipped
#ifdef ATOM_AMX_BF16
      // batch-invariant on the tiles: a row's softmax steps start at the same keys in any unit (the
      // keys before its window that a unit adds are whole steps it does not see: exact no-ops)
      if (use_amx && partition > 0) lo = lo / (AMX_CHUNKS * 16) * (AMX_CHUNKS * 16);
#endif
      units.push_back({b, i, q_end, lo, hi});
      max_span = std::max(max_span, hi - lo);
    }
  }
  const int num_units = units.size();
  const int threads = at::get_num_threads();
  // The work items: each unit's keys, whole or in partitions whose partial results (unnormalised
  // output, running max and sum) are merged afterwards (flash-decoding). By default the keys are
  // split only when there are too few units for the threads (a few long decodes), evenly; with
  // `partition` > 0 they are always split at its multiples, so that a row's sums never depend on
  // the rest of the batch (batch-invariant), and always merged (a single partition merges to the
  // same bits as no split).
  const int fixed = int(partition);
  struct Item {
    int unit, key_lo, key_hi;
  };
  std::vector<Item> items;
  std::vector<int> first_item(num_units + 1, 0);  // unit u's items: [first_item[u], first_item[u + 1])
  bool merged;
  if (fixed > 0) {
    for (int ui = 0; ui < num_units; ++ui) {
      first_item[ui] = items.size();
      const Unit& u = units[ui];
      for (int lo = u.key_lo; lo < u.key_hi; lo = (lo / fixed + 1) * fixed)
        items.push_back({ui, lo, std::min(u.key_hi, (lo / fixed + 1) * fixed)});
    }
    merged = true;
  } else {
    const int max_splits = std::max(1, (max_span + 511) / 512);
    const int splits = std::min(max_splits, std::max(1, (4 * threads + num_units - 1) / num_units));
    const int part = ((max_span + splits - 1) / splits + BS - 1) / BS * BS;
    for (int ui = 0; ui < num_units; ++ui) {
      first_item[ui] = items.size();
      const Unit& u = units[ui];
      for (int split = 0; split < splits; ++split) {
        const int lo = u.key_lo + split * part;  // past the unit's keys: an empty partial, skipped in the merge
        items.push_back({ui, lo, std::min(u.key_hi, lo + part)});
      }
    }
    merged = splits > 1;
  }
  first_item[num_units] = items.size();
  const int max_rows = tile * H;  // rows: kv head major, then query token, then head of the group
  int part_rows = 0;  // a partial's rows: the most any unit of this call has (a decode's H)
  for (const Unit& u : units) part_rows = std::max(part_rows, (u.q_end - u.q_begin) * H);
  // one task per item when the units alone cannot keep the threads busy, else one per unit
  // (its partitions in order, merged in the task: no partials kept for the whole step)
  const bool per_item = merged && num_units < 4 * threads;
  std::vector<float> partial_o, partial_ml;
  if (per_item) {
    partial_o.assign(items.size() * part_rows * D, 0.f);
    partial_ml.assign(items.size() * part_rows * 2, 0.f);
  }
  auto out_row = [&](const Unit& u, int nt, int r) {
    const int h = r / (nt * G), i = u.q_begin + (r / G) % nt, g = r % G;
    return op + (int64_t(qstart[u.seq] + i) * H + h * G + g) * D;
  };
  // the sink's term of the softmax denominator (relative to the row's running max mx), 0 without sinks
  auto sink_term = [&](int nt, int r, float mx) {
    return sinks ? std::exp(sinks[r / (nt * G) * G + r % G] - mx) : 0.f;
  };
  // a unit's rows from its `count` partials (ml: [count][part_rows][2], o: [count][part_rows][D])
  auto merge = [&](const Unit& u, int count, const float* ml, const float* po, float* acc) {
    const int nt = u.q_end - u.q_begin;
    for (int r = 0; r < nt * H; ++r) {
      float mx = NEG_INF;
      for (int s = 0; s < count; ++s) mx = std::max(mx, ml[(s * part_rows + r) * 2]);
      std::fill(acc, acc + D, 0.f);
      float sum = 0.f;
      for (int s = 0; s < count; ++s) {
        const size_t base = size_t(s) * part_rows + r;
        const float ms = ml[base * 2];
        if (ms == NEG_INF) continue;  // a partition past the row's causal bound
        const float w = std::exp(ms - mx);
        sum += w * ml[base * 2 + 1];
        for (int d = 0; d < D; ++d) acc[d] += w * po[base * D + d];
      }
      T* dst = out_row(u, nt, r);
      sum += sink_term(nt, r, mx);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int d = 0; d < D; ++d) dst[d] = T(acc[d] * inv);
    }
  };

  const int64_t num_tasks = per_item ? int64_t(items.size()) : num_units;
  // Units taken one by one as threads come free, heaviest (rows x keys) first: split in contiguous
  // shares, a lone fresh prompt's later tiles (which see more keys) had fallen to one thread,
  // up to three times the other's work.
  std::vector<int> heaviest_first;
  std::atomic<int64_t> next_unit{0};
  if (!per_item) {
    heaviest_first.resize(num_units);
    std::iota(heaviest_first.begin(), heaviest_first.end(), 0);
    auto work = [&](int ui) { return int64_t(units[ui].q_end - units[ui].q_begin) * (units[ui].key_hi - units[ui].key_lo); };
    std::stable_sort(heaviest_first.begin(), heaviest_first.end(), [&](int a, int b) { return work(a) > work(b); });
  }
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(max_rows * D), o(max_rows * D), kt(D * KW), vb(KW * D), m(max_rows), l(max_rows), acc(D);
    std::vector<float> unit_o, unit_ml;  // a unit's partials, when its task merges them
    std::vector<int> qpos(max_rows);
    [[maybe_unused]] constexpr bool is_bf16 = std::is_same_v<T, c10::BFloat16>;
#ifdef ATOM_AVX512_BF16
    const bool native = is_bf16 && g_native;
    std::vector<uint32_t> qpairs(native ? max_rows * D / 2 : 0), kpairs(native ? D / 2 * 16 : 0);
#endif
#ifdef ATOM_AMX_BF16
    std::unique_ptr<AmxScratch> amx;
    if (use_amx) amx = std::make_unique<AmxScratch>(H, KVH, D);
#endif
    // rows' m, l, o over keys [key_lo, key_hi) of unit u
    auto attend = [&](const Unit& u, int key_lo, int key_hi, int fetch_hi = -1, bool fetched = false) {
      const int first_pos = lens[u.seq] - (qstart[u.seq + 1] - qstart[u.seq]);
      const int nt = u.q_end - u.q_begin, rows = nt * H, group_rows = nt * G;
      // Few rows a head (decodes) take their scores from the keys as they lie, where staging the
      // keys (transposed as floats, or as bfloat16 pairs) would cost more than folding each row's
      // sums; batch-invariant calls always stage, so a row's sums are the same whichever tile it is in.
      const bool row_scores = fixed == 0 && group_rows * 10 <= D;
      std::fill(o.begin(), o.begin() + rows * D, 0.f);
      std::fill(m.begin(), m.begin() + rows, NEG_INF);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int* table = tables + int64_t(u.seq) * max_blocks;
#ifdef ATOM_AMX_BF16
      if (amx) {
        amx_attend(*amx, reinterpret_cast<const c10::BFloat16*>(qp) + (int64_t(qstart[u.seq]) + u.q_begin) * H * D, nt,
                   first_pos + u.q_begin, reinterpret_cast<const c10::BFloat16*>(kp),
                   reinterpret_cast<const c10::BFloat16*>(vp), slot_stride, table, BS, key_lo, key_hi,
                   fetch_hi < 0 ? key_hi : fetch_hi, fetched, window, float(scale), m.data(), l.data(), o.data());
        return;
      }
#endif
      for (int r = 0; r < rows; ++r) {  // scaled, as float
        const int h = r / group_rows, i = u.q_begin + (r / G) % nt, g = r % G;
        const T* src = qp + (int64_t(qstart[u.seq] + i) * H + h * G + g) * D;
        qpos[r] = first_pos + i;
#ifdef ATOM_AVX512_BF16
        if (native) {  // the row as bfloat16 pairs, unscaled (the scores are scaled in float)
          std::memcpy(&qpairs[r * D / 2], src, D * sizeof(T));
          continue;
        }
#endif
        for (int d = 0; d < D; ++d) qs[r * D + d] = float(src[d]) * float(scale);
      }
      auto slot_of = [&](int key) { return int64_t(table[key / BS]) * BS + key % BS; };
      for (int key0 = key_lo, n = 0; key0 < key_hi; key0 += n) {
        n = std::min({KW, key_hi - key0, BS - key0 % BS});  // a chunk never crosses a block
        const int64_t slot = slot_of(key0);
        const int ahead = key0 + PREFETCH_CHUNKS * n;
        Ahead ak, av;
        if (ahead < key_hi) {
          const int64_t bytes = std::min({KW, key_hi - ahead, BS - ahead % BS}) * slot_stride * int64_t(sizeof(T));
          ak = {reinterpret_cast<const char*>(kp + slot_of(ahead) * slot_stride), bytes};
          av = {reinterpret_cast<const char*>(vp + slot_of(ahead) * slot_stride), bytes};
        }
        const int64_t piece = (ak.left / (2 * KVH) + 63) / 64 * 64;  // a quarter of a head's share
        for (int h = 0; h < KVH; ++h) {
          ak.issue(piece);
          const T* kb = kp + slot * slot_stride + int64_t(h) * D;
          const T* vsrc = vp + slot * slot_stride + int64_t(h) * D;
          const int r0 = h * group_rows;
#ifdef ATOM_AVX512_BF16
          if constexpr (is_bf16) {
            if (native) {
              const bool staged = !row_scores;
              if (staged) stage_key_pairs(kb, slot_stride, n, D / 2, kpairs.data());
              ak.issue(h + 1 < KVH ? piece : ak.left);
              av.issue(piece);
              bf16_rows_dispatch(group_rows, &qpairs[r0 * D / 2], D / 2, staged ? kpairs.data() : nullptr, kb,
                                 slot_stride, vsrc, slot_stride, n, &qpos[r0], key0, window, float(scale), &m[r0],
                                 &l[r0], &o[r0 * D]);
              av.issue(h + 1 < KVH ? piece : av.left);
              continue;
            }
          }
#endif
          const bool staged = !(SCORES_FROM_KEYS && row_scores);
          if (staged) stage_keys(kb, slot_stride, n, D, kt.data());
          ak.issue(h + 1 < KVH ? piece : ak.left);
          av.issue(piece);
          const float* v;
          int64_t ldv;
          if constexpr (std::is_same_v<T, float>) {
            v = vsrc;
            ldv = slot_stride;
          } else {
            for (int j = 0; j < n; ++j)
              for (int d = 0; d < D; d += 8) store(&vb[j * D + d], load_as_float(vsrc + j * slot_stride + d));
            v = vb.data();
            ldv = D;
          }
          if (fixed > 0)
            rows_dispatch<true>(group_rows, &qs[r0 * D], D, kt.data(), kb, slot_stride, v, ldv, n, &qpos[r0], key0,
                                window, &m[r0], &l[r0], &o[r0 * D]);
          else
            rows_dispatch<false>(group_rows, &qs[r0 * D], D, staged ? kt.data() : nullptr, kb, slot_stride, v, ldv, n,
                                 &qpos[r0], key0, window, &m[r0], &l[r0], &o[r0 * D]);
          av.issue(h + 1 < KVH ? piece : av.left);
        }
      }
#ifdef ATOM_AVX512_BF16
      if (native) unpermute_rows(o.data(), rows, D, acc.data());
#endif
    };
    // a partial (unnormalised output, running max and sum) into ml/po at slot s
    auto keep = [&](int rows, float* ml, float* po, int s) {
      std::copy(o.begin(), o.begin() + rows * D, po + size_t(s) * part_rows * D);
      for (int r = 0; r < rows; ++r) {
        ml[(size_t(s) * part_rows + r) * 2] = m[r];
        ml[(size_t(s) * part_rows + r) * 2 + 1] = l[r];
      }
    };
    if (per_item) {  // this thread's tasks are in order: a unit's next partition is often the next task
      for (int64_t task = begin; task < end; ++task) {
        const Item& it = items[task];
        const bool next_same = task + 1 < end && items[task + 1].unit == it.unit;
        const bool prev_same = task > begin && items[task - 1].unit == it.unit;
        attend(units[it.unit], it.key_lo, it.key_hi, next_same ? items[task + 1].key_hi : it.key_hi, prev_same);
        keep((units[it.unit].q_end - units[it.unit].q_begin) * H, partial_ml.data(), partial_o.data(), int(task));
      }
      return;
    }
    // one unit at a time, the next one the heaviest left, whichever thread is free (each unit's
    // result is its own: which thread runs it changes nothing)
    for (int64_t next; (next = next_unit.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
      const int64_t task = heaviest_first[next];
      const Unit& u = units[task];
      const int nt = u.q_end - u.q_begin, rows = nt * H, count = first_item[task + 1] - first_item[task];
      if (merged) {
        unit_o.resize(size_t(count) * part_rows * D);
        unit_ml.resize(size_t(count) * part_rows * 2);
        for (int s = 0; s < count; ++s) {
          const Item& it = items[first_item[task] + s];
          attend(u, it.key_lo, it.key_hi, u.key_hi, s > 0);  // the partitions in order: each fetches the next
          keep(rows, unit_ml.data(), unit_o.data(), s);
        }
        merge(u, count, unit_ml.data(), unit_o.data(), acc.data());
        continue;
      }
      attend(u, items[first_item[task]].key_lo, items[first_item[task]].key_hi);
      for (int r = 0; r < rows; ++r) {
        T* dst = out_row(u, nt, r);
        const float sum = l[r] + sink_term(nt, r, m[r]);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int d = 0; d < D; ++d) dst[d] = T(o[r * D + d] * inv);
      }
    }
  });
  if (!per_item) return;
  at::parallel_for(0, num_units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t ui = begin; ui < end; ++ui) {
      const size_t first = first_item[ui];
      merge(units[ui], first_item[ui + 1] - first_item[ui], partial_ml.data() + first * part_rows * 2,
            partial_o.data() + first * part_rows * D, acc.data());
    }
  });
}

template <typename T>
struct PagedAttention {
  template <typename... Args>
  static void run(Args&&... args) {
    paged_attention_impl<T>(args...);
  }
};

}  // namespace

// out[t, h] = softmax(q[t, h] . K^T * scale) V over the causal context of
// t's sequence (its last sliding_window keys when sliding_window > 0), K and
// V read from the paged cache through block_tables. sinks (float32 [H]):
// one logit per head that joins the softmax denominator only. partition > 0:
// the keys are split at its multiples whatever the batch, so each row's
// result is the same bits alone, batched, or in any prefill chunk.
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                     int64_t block_size, double scale, int64_t sliding_window, const c10::optional<at::Tensor>& sinks,
                     int64_t partition) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % KW == 0, "paged_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt,
              "paged_attention: block_tables, seq_lens and query_start must be int32");
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(partition >= 0 && partition % KW == 0 && partition % block_size == 0,
              "paged_attention: partition must be 0 (adaptive) or a multiple of 16 and of block_size");
  const float* sink_logits = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "paged_attention: sinks must be contiguous float32 [num_heads]");
    sink_logits = sinks->data_ptr<float>();
  }
  dispatch<PagedAttention>(q.scalar_type(), "paged_attention", out, q, k_cache, v_cache, block_tables, seq_lens,
                           query_start, block_size, scale, sliding_window, sink_logits, partition);
}

// the variants this build runs beyond the portable (AVX2 or plain) code, by name
std::vector<std::string> native_kernels() {
  std::vector<std::string> names;
#ifdef ATOM_AVX512_BF16
  names.push_back("paged_attention_avx512_bf16");
#endif
#ifdef ATOM_AMX_BF16
  if (amx_permitted()) {
    names.push_back("paged_attention_amx_bf16");
    names.push_back("linear_amx_bf16");  // gemm.cpp
  }
#endif
#ifdef ATOM_ELEMENTWISE_AVX512
  names.push_back("elementwise_avx512");  // ops.cpp
#endif
  return names;
}

namespace atom {
bool native_kernels_enabled() { return g_native; }
}  // namespace atom

// turns the native variants on or off (the portable twins run instead); returns the previous setting
bool set_native_kernels(bool enabled) {
  const bool before = g_native;
  g_native = enabled;
  return before;
}

// turns the AMX variant on or off (the AVX-512 one runs instead); returns the previous setting
bool set_amx_kernels(bool enabled) {
  const bool before = g_amx;
  g_amx = enabled;
  return before;
}

// what set_native_kernels and set_amx_kernels last set
std::tuple<bool, bool> kernel_settings() { return {g_native, g_amx}; }

TORCH_LIBRARY(atom, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start, int block_size, float scale, int sliding_window=0, "
      "Tensor? sinks=None, int partition=0) -> ()");
  m.def("native_kernels() -> str[]", &native_kernels);
  m.def("set_native_kernels(bool enabled) -> bool", &set_native_kernels);
  m.def("set_amx_kernels(bool enabled) -> bool", &set_amx_kernels);
  m.def("kernel_settings() -> (bool, bool)", &kernel_settings);
}

TORCH_LIBRARY_IMPL(atom, CPU, m) { m.impl("paged_attention", &paged_attention); }
