// The AVX512-BF16 variant of the paged attention, for bfloat16 caches: scores as bfloat16 pair
// dot products (vdpbf16ps: products exact, sums in float32) over keys transposed as pairs, and
// values read as bfloat16 into 16-float FMAs, in place of staging every key and value as float.
// Included where the build targets AVX512-BF16; its twin is the portable (AVX2) variant.
#pragma once

#ifndef ATOM_AVX512_BF16
#error "attention_avx512_bf16.h needs a build that targets AVX512-BF16"
#endif

#include <cstring>
#include <vector>

#include "attention_loop.h"
#include "vec.h"

namespace atom::attention {

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

struct Avx512Bf16 : Chunked<Avx512Bf16, c10::BFloat16> {
  using T = c10::BFloat16;
  static constexpr bool SCORES_FROM_KEYS = true;

  struct Scratch : ChunkedScratch {
    std::vector<uint32_t> qpairs, kpairs;  // the rows as dim pairs; a chunk's keys as pairs, transposed
    std::vector<float> row;                // one row, for unpermute_rows
    Scratch(const Problem<T>& p, int max_rows)
        : ChunkedScratch(max_rows), qpairs(max_rows * p.D / 2), kpairs(p.D / 2 * 16), row(p.D) {}
  };

  // the row as bfloat16 pairs, unscaled (the scores are scaled in float)
  static void load_query(Scratch& s, const Problem<T>& p, int r, const T* q) {
    std::memcpy(&s.qpairs[r * p.D / 2], q, p.D * sizeof(T));
  }

  static void stage_keys(Scratch& s, const Problem<T>& p, const T* k, int n) {
    stage_key_pairs(k, p.slot_stride, n, p.D / 2, s.kpairs.data());
  }

  static void step(Scratch& s, const Problem<T>& p, const Chunk<T>& c, int r0, int count, bool staged, Rows rows) {
    bf16_rows_dispatch(count, &s.qpairs[r0 * p.D / 2], p.D / 2, staged ? s.kpairs.data() : nullptr, c.k,
                       p.slot_stride, c.v, p.slot_stride, c.n, &s.qpos[r0], c.key0, p.window, p.scale, rows.m + r0,
                       rows.l + r0, rows.o + r0 * p.D);
  }

  static void finish(Scratch& s, const Problem<T>& p, int num_rows, float* o) {
    unpermute_rows(o, num_rows, p.D, s.row.data());
  }
};

}  // namespace atom::attention
