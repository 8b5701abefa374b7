// The AVX512-BF16 variant of the paged attention, for bfloat16 caches: scores as bfloat16 pair
// dot products (vdpbf16ps: products exact, sums in float32) over keys transposed as pairs, and
// values read as bfloat16 into 16-float FMAs, in place of staging every key and value as float.
// Included where the build targets AVX512-BF16; its twin is the portable (AVX2) variant.
#pragma once

#ifndef ATOM_AVX512_BF16
#error "attention_avx512_bf16.h needs a build that targets AVX512-BF16"
#endif

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
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

// each row of o back in dim order from where its accumulators kept dim d (slot(d): bf16_slot_of_dim
// by default), times `scale` (a power of two: exact)
template <class Slot>
inline void unpermute_rows(float* o, int rows, int D, float* tmp, Slot slot, float scale = 1.f) {
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < D; ++d) tmp[d] = o[r * D + slot(d)] * scale;
    std::memcpy(o + r * D, tmp, D * sizeof(float));
  }
}
inline void unpermute_rows(float* o, int rows, int D, float* tmp) {
  unpermute_rows(o, rows, D, tmp, [D](int d) { return bf16_slot_of_dim(d, D); });
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

// The reduction tree of the scores from the keys as they lie: four keys' 16-lane sums folded into
// one vector (fold_keys4), two of those (fold_keys8), two of those (fold_keys16, lane j: key j)
inline __m512 fold_keys4(const __m512* a) {
  const __m512 b0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
  const __m512 b1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, 0x88), _mm512_shuffle_f32x4(b0, b1, 0xDD));
}
inline __m512 fold_keys8(const __m512* c) {
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
}
inline __m512 fold_keys16(const __m512* d) {
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
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
      for (int r = 0; r < NR; ++r) c[r][g] = fold_keys4(a[r]);
    }
    for (int r = 0; r < NR; ++r) d[r][h] = fold_keys8(c[r]);
  }
  for (int r = 0; r < NR; ++r) s[r] = fold_keys16(d[r]);
}

// rows at or under this many per kv head take their scores from the keys as they lie
constexpr int ROW_SCORES_MAX = 4;

// the lanes of a chunk's n keys from key0 that a row at position qpos sees: causal, and within the
// sliding window (window > 0)
inline __mmask16 visible_keys(int n, int qpos, int key0, int window) {
  const int visible = std::min(n, qpos - key0 + 1);  // causal: keys up to the row's own position
  __mmask16 keep = visible <= 0 ? 0 : visible >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << visible) - 1);
  if (window > 0) {  // sliding window: keys after the row's position - window
    const int first = qpos - window + 1 - key0;
    if (first > 0) keep &= first >= 16 ? 0 : __mmask16(~((1u << first) - 1));
  }
  return keep;
}

// The online softmax's step for NR rows over a chunk's n scores s (unscaled): each row's masked,
// scaled scores, its running max m and sum l updated, its probabilities as bfloat16 into pb
// (row r: pb[16 r .. 16 r + 15], zero past the visible keys) and the factor its output so far is
// to be scaled by (1: unchanged).
template <int NR>
inline void bf16_softmax(const __m512* s, int n, const int* qpos, int key0, int window, float scale, float* m,
                         float* l, uint16_t* pb, float* alpha) {
  for (int r = 0; r < NR; ++r) {
    alpha[r] = 1.f;
    const __mmask16 keep = visible_keys(n, qpos[r], key0, window);
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

// n rows of D fp8 elements (a row every ld) as bfloat16 rows of D (a row every D), exactly: e5m2
// and e4m3fn widened to float16 bits (vec.h's fp8_half_bits), to float, to bfloat16 (their 2 and 3
// mantissa bits fit its 7)
template <typename C>
inline void fp8_rows_to_bf16(const C* src, int64_t ld, int n, int D, c10::BFloat16* dst) {
  for (int j = 0; j < n; ++j)
    for (int d = 0; d < D; d += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * ld + d));
      const __m128i lo = fp8_half_bits(_mm_cvtepu8_epi16(bytes), src);
      const __m128i hi = fp8_half_bits(_mm_cvtepu8_epi16(_mm_srli_si128(bytes, 8)), src);
      __m512 f = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
      if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) f = _mm512_mul_ps(f, _mm512_set1_ps(FP8_E4M3_UNIT));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * D + d), (__m256i)_mm512_cvtneps_pbh(f));
    }
}

// A decode's rows over an fp8 cache read the keys and values in registers, 64 bytes a row at a time:
// each byte widened into the high half of a 16-bit word (one unpack against zero, which also
// spreads a row's dims over two registers: per 128-bit lane, dims 0-7 of its 16 in the first and
// 8-15 in the second, fp8_key_slot) and moved into bfloat16's fields by a shift and an and
// (fp8_as_bf16): the value times 2^-FP8_BIAS<C> (bias 127 against 15 or 7). The queries and the
// probabilities are scaled up by 2^64 so that no product of normal values falls below float's
// normal range; the scores and the outputs are scaled back by FP8_UNDO<C> (all powers of two:
// exact). The formats' subnormals (e5m2's below 2^-14, e4m3's below 2^-6) become bfloat16 denormals,
// which vdpbf16ps reads as zero: the portable twin reads them exactly.
template <typename C>
constexpr int FP8_BIAS = std::is_same_v<C, c10::Float8_e5m2> ? 112 : 120;
constexpr float FP8_UP = 18446744073709551616.f;  // 2^64
template <typename C>
constexpr float FP8_UNDO = std::is_same_v<C, c10::Float8_e5m2> ? 281474976710656.f : 72057594037927936.f;  // 2^48, 2^56
static_assert(FP8_BIAS<c10::Float8_e5m2> - 64 == 48 && FP8_BIAS<c10::Float8_e4m3fn> - 64 == 56);

// words holding an fp8 byte in their high half, as bfloat16 bits (see above)
template <typename C>
inline __m512i fp8_as_bf16(__m512i words) {
  if constexpr (std::is_same_v<C, c10::Float8_e5m2>)  // s eeeee mm -> s 000 eeeee mm00000
    return _mm512_and_si512(_mm512_srai_epi16(words, 3), _mm512_set1_epi16(int16_t(0x8FFF)));
  else  // s eeee mmm -> s 0000 eeee mmm0000
    return _mm512_and_si512(_mm512_srai_epi16(words, 4), _mm512_set1_epi16(int16_t(0x87FF)));
}

#ifdef __GFNI__
// With GFNI (every Zen 4 and 5, Ice Lake and later; not Cooper Lake) the same words in fewer steps:
// each byte's two halves of its word by one affine bit map each (gf2p8affineqb: output bit i is the
// parity of the input's bits selected by byte 7 - i of the matrix), then the halves interleaved by
// the unpacks that spread the bytes anyway: four operations for 64 bytes where the shift and the
// and take six. Bit for bit fp8_as_bf16's words (every byte: tests/models/test_kv_fp8.py).
// out_bit <- in_bit pairs as a gf2p8affineqb matrix
constexpr uint64_t bit_map(std::initializer_list<std::pair<int, int>> moves) {
  uint64_t a = 0;
  for (const auto& [out, in] : moves) a |= (uint64_t(1) << in) << (8 * (7 - out));
  return a;
}
// a word's high byte (s 000 eeee for e5m2's s eeeee mm: s 000 e4 e3 e2 e1; e4m3's s eeee mmm:
// s 0000 e3 e2 e1) and low byte (e5m2: e0 m1 m0 00000; e4m3: e0 m2 m1 m0 0000)
template <typename C>
constexpr uint64_t FP8_HIGH_BYTE = std::is_same_v<C, c10::Float8_e5m2>
                                       ? bit_map({{7, 7}, {3, 6}, {2, 5}, {1, 4}, {0, 3}})
                                       : bit_map({{7, 7}, {2, 6}, {1, 5}, {0, 4}});
template <typename C>
constexpr uint64_t FP8_LOW_BYTE = std::is_same_v<C, c10::Float8_e5m2> ? bit_map({{7, 2}, {6, 1}, {5, 0}})
                                                                      : bit_map({{7, 3}, {6, 2}, {5, 1}, {4, 0}});
constexpr bool FP8_AFFINE = true;
#else
constexpr bool FP8_AFFINE = false;
#endif

// 64 fp8 bytes as the bfloat16 words of fp8_as_bf16(unpacklo(0, x)) and of fp8_as_bf16(unpackhi(0, x)):
// by the affine maps where the build has GFNI (Affine), else by the shift and the and
template <typename C, bool Affine = FP8_AFFINE>
inline void fp8_words(__m512i x, __m512bh& lo, __m512bh& hi) {
  static_assert(FP8_AFFINE || !Affine, "the affine form needs a build with GFNI");
  if constexpr (Affine) {
#ifdef __GFNI__
    const __m512i h = _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(int64_t(FP8_HIGH_BYTE<C>)), 0);
    const __m512i l = _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(int64_t(FP8_LOW_BYTE<C>)), 0);
    lo = (__m512bh)_mm512_unpacklo_epi8(l, h), hi = (__m512bh)_mm512_unpackhi_epi8(l, h);
#endif
  } else {
    lo = (__m512bh)fp8_as_bf16<C>(_mm512_unpacklo_epi8(_mm512_setzero_si512(), x));
    hi = (__m512bh)fp8_as_bf16<C>(_mm512_unpackhi_epi8(_mm512_setzero_si512(), x));
  }
}

// where dim d of a 64-dim block lies once a row's bytes are widened (fp8_as_bf16 of unpacklo, then
// of unpackhi, each 32 words): per 128-bit lane L, dims 16L..16L+7, then 16L+8..16L+15
inline int fp8_key_slot(int d) { return d / 64 * 64 + (d % 16) / 8 * 32 + (d % 64) / 16 * 8 + d % 8; }

// n (a multiple of 64) fp8 bytes as the registers' bfloat16 words, in the bytes' order (out[d]: byte
// d's word), by either form (affine: GFNI's, where built): the op fp8_bf16_words, for the tests
template <typename C, bool Affine>
inline void fp8_words_in_order(const uint8_t* bytes, int64_t n, int16_t* out) {
  alignas(64) int16_t w[64];
  for (int64_t i = 0; i < n; i += 64) {
    __m512bh lo, hi;
    fp8_words<C, Affine>(_mm512_loadu_si512(bytes + i), lo, hi);
    _mm512_store_si512(w, (__m512i)lo), _mm512_store_si512(w + 32, (__m512i)hi);
    for (int d = 0; d < 64; ++d) out[i + d] = w[fp8_key_slot(d)];
  }
}

// where the values' accumulators keep output dim d of a 64-dim block: two keys' bytes interleaved
// and widened give four registers of pairs, register k lane L holding dims 16L + 4k .. 16L + 4k + 3
inline int fp8_value_slot(int d) { return d / 64 * 64 + (d % 16) / 4 * 16 + (d % 64) / 16 * 4 + d % 4; }

// scores of NR rows (q: bfloat16 in fp8_key_slot order, times 2^64) for the chunk's n keys, each
// key's products summed in 16 lanes, then folded: keys grp, grp + 4, grp + 8, grp + 12 into one
// vector (fold_keys4), then those four (fold_keys8, fold_keys16; lane j: key j), as
// bf16_scores_from_rows folds; every loop unrolled, so the sums stay in registers
template <int NR, typename C>
inline void fp8_scores_from_rows(const c10::BFloat16* q, int D, const C* k, int64_t ldk, int n, __m512* s) {
  __m512 c[NR][4];
#pragma GCC unroll 4
  for (int grp = 0; grp < 4; ++grp) {
    __m512 a[NR][4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) a[r][t] = _mm512_setzero_ps();
      const int key = 4 * t + grp;
      if (key >= n) continue;  // a zero vector: its lane is masked afterwards
      for (int dim = 0; dim < D; dim += 64) {
        __m512bh lo, hi;
        fp8_words<C>(_mm512_loadu_si512(k + key * ldk + dim), lo, hi);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          const __m512bh qlo = (__m512bh)_mm512_loadu_si512(q + r * D + dim);
          const __m512bh qhi = (__m512bh)_mm512_loadu_si512(q + r * D + dim + 32);
          a[r][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[r][t], qlo, lo), qhi, hi);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) c[r][grp] = fold_keys4(a[r]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const __m512 d[2] = {fold_keys8(&c[r][0]), fold_keys8(&c[r][2])};
    s[r] = fold_keys16(d);
  }
}

// o (fp8_value_slot order) += p . v for NR rows over the chunk's n values, two keys at a time:
// pp row r, keys 2i and 2i + 1 at pp[r * 8 + i] (bfloat16, times 2^64)
template <int NR, typename C>
inline void fp8_values(const uint32_t* pp, const C* v, int64_t ldv, int n, int D, float* o) {
  const __m512i zero = _mm512_setzero_si512();
  for (int dim = 0; dim < D; dim += 64) {
    __m512 acc[NR][4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_loadu_ps(o + r * D + dim + 16 * k);
    for (int j = 0; j < n; j += 2) {
      const __m512i a = _mm512_loadu_si512(v + j * ldv + dim);
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * ldv + dim) : zero;
      __m512bh w[4];
      fp8_words<C>(_mm512_unpacklo_epi8(a, b), w[0], w[1]);
      fp8_words<C>(_mm512_unpackhi_epi8(a, b), w[2], w[3]);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(pp[r * 8 + j / 2]);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], pr, w[k]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(o + r * D + dim + 16 * k, acc[r][k]);
  }
}

// f(std::integral_constant<int, NR>, r) for `rows` rows in blocks of ROW_SCORES_MAX, then the rest
template <int NR = ROW_SCORES_MAX, class F>
inline void in_row_blocks(int rows, F&& f, int r = 0) {
  if constexpr (NR > 0) {
    for (; rows >= NR; rows -= NR, r += NR) f(std::integral_constant<int, NR>{}, r);
    if (rows > 0) in_row_blocks<NR - 1>(rows, f, r);
  }
}

// The AVX512-BF16 variant over an fp8 cache (kv_cache_dtype). A decode's few rows a kv head
// (attend's two passes) read the keys and values in registers: half the bytes of a bfloat16 cache,
// which a long decode is bound by; more rows (prefill) widen each chunk's keys and values of a kv
// head to bfloat16 in L1, exactly, and take the bfloat16 variant's steps over them
// (attend_in_chunks), except in batch-invariant calls, where every row takes the registers' path,
// so that a row's bits are its own whatever the unit holds (until 2026-12-07 those calls widened
// every chunk instead, and a decode at 32k over fp8 took 1.45x bfloat16's time on a Zen 4: now
// 0.65x). head_dim a multiple of 64 (fits).
template <typename C>
struct Avx512Bf16Fp8 : Chunked<Avx512Bf16Fp8<C>, c10::BFloat16, C> {
  using T = c10::BFloat16;
  using P = Problem<T, C>;
  static constexpr bool SCORES_FROM_KEYS = false;  // attend_in_chunks' rows: staged
  static constexpr int SEG = 256;                  // the keys one pair of passes covers: its scores stay in L1
  static constexpr bool ROW_RANGES = false;        // decode takes every row of a unit

  static bool fits(const P& p) { return p.D % 64 == 0; }

  struct Scratch : ChunkedScratch {
    std::vector<uint32_t> qpairs, kpairs;
    std::vector<T> qrows;   // the rows in fp8_key_slot order, times 2^64 (the decode's passes)
    std::vector<float> row, scores, sums;  // one row; the rows' scores over a segment [rows][SEG + KW]; sums [rows][16]
    std::vector<T> kb, vb;  // a chunk's keys and values of one kv head, as bfloat16 [KW][D] (the staged path)
    Scratch(const P& p, int max_rows)
        : ChunkedScratch(max_rows),
          qpairs(max_rows * p.D / 2),
          kpairs(p.D / 2 * 16),
          qrows(max_rows * p.D),
          row(p.D),
          scores(size_t(max_rows) * (SEG + KW)),
          sums(max_rows * 16),
          kb(KW * p.D),
          vb(KW * p.D) {}
  };

  static void load_query(Scratch& s, const P& p, int r, const T* q) {
    std::memcpy(&s.qpairs[r * p.D / 2], q, p.D * sizeof(T));
  }

  static void stage_keys(Scratch& s, const P& p, const C* k, int n) {
    fp8_rows_to_bf16(k, p.slot_stride, n, p.D, s.kb.data());
    stage_key_pairs(s.kb.data(), p.D, n, p.D / 2, s.kpairs.data());
  }

  static void step(Scratch& s, const P& p, const Chunk<C>& c, int r0, int count, bool, Rows rows) {
    fp8_rows_to_bf16(c.v, p.slot_stride, c.n, p.D, s.vb.data());
    bf16_rows_dispatch(count, &s.qpairs[r0 * p.D / 2], p.D / 2, s.kpairs.data(), s.kb.data(), p.D, s.vb.data(), p.D,
                       c.n, &s.qpos[r0], c.key0, p.window, p.scale, rows.m + r0, rows.l + r0, rows.o + r0 * p.D);
  }

  static void finish(Scratch& s, const P& p, int num_rows, float* o) { unpermute_rows(o, num_rows, p.D, s.row.data()); }

  static void attend(Scratch& s, const P& p, const Unit& u, const Span& span, Rows rows) {
    const int nt = u.tokens(), group_rows = nt * p.G;
    if (p.partition == 0 && group_rows * 10 > p.D) return attend_in_chunks<Avx512Bf16Fp8>(s, p, u, span, rows);
    decode(s, p, u, span, rows);
  }

  // A decode's rows over the span in segments of SEG keys (cut at multiples of SEG: a row's
  // segments do not depend on where its unit's keys begin), two passes each: every chunk's scores
  // into s.scores (no softmax between the chunks: the keys stream), the rows' maxima (what the
  // rows had so far rescaled once), then every chunk's probabilities and values. Each row's
  // arithmetic is its own: the same alone, in a batch, or among a prefill unit's rows.
  static void decode(Scratch& s, const P& p, const Unit& u, const Span& span, Rows rows) {
    const int H = p.H, G = p.G, D = p.D, KVH = p.KVH, BS = p.BS;
    const int nt = u.tokens(), num_rows = nt * H, group_rows = nt * G;
    constexpr int LD = SEG + KW;
    for_unit_rows(p, u, 0, num_rows, [&](int r, int pos, const T* q) {
      s.qpos[r] = pos;
      for (int d = 0; d < D; ++d) s.qrows[r * D + fp8_key_slot(d)] = T(float(q[d]) * FP8_UP);
    });
    std::fill(s.sums.begin(), s.sums.begin() + num_rows * 16, 0.f);
    const int* table = p.tables + int64_t(u.seq) * p.max_blocks;
    // f(key0, n, slot, h) for each chunk of [lo, hi) (ChunkWalk) and kv head h; the lines of the chunk
    // PREFETCH_CHUNKS on, of `cache`, fetched a head's share at a time between the heads' work
    // (attend_in_chunks' Ahead: one burst a chunk stalls the core)
    auto each_chunk = [&](int lo, int hi, const C* cache, auto&& f) {
      ChunkWalk walk(table, BS, lo, hi), ahead(table, BS, lo, span.hi);
      for (int i = 0; i < PREFETCH_CHUNKS && !ahead.done(); ++i) ahead.next();
      for (; !walk.done(); walk.next()) {
        Ahead lines;
        int64_t piece = 0;
        if (!ahead.done()) {
          const int64_t head_bytes = ahead.size() * int64_t(D) * int64_t(sizeof(C));
          lines = {reinterpret_cast<const char*>(cache + ahead.slot() * p.slot_stride), head_bytes * KVH};
          piece = (head_bytes + 63) / 64 * 64;
          ahead.next();
        }
        for (int h = 0; h < KVH; ++h, lines.issue(piece)) f(walk.key, walk.size(), walk.slot(), h);
      }
    };
    const float scale = p.scale * FP8_UNDO<C>;
    for (int seg = span.lo, seg_hi; seg < span.hi; seg = seg_hi) {
      seg_hi = std::min(span.hi, (seg / SEG + 1) * SEG);  // at multiples of SEG, wherever the span begins
      each_chunk(seg, seg_hi, p.k, [&](int key0, int n, int64_t slot, int h) {  // the scores
        const C* k = p.k + slot * p.slot_stride + h * D;
        in_row_blocks(group_rows, [&](auto nr, int r) {
          constexpr int NR = decltype(nr)::value;
          const int r0 = h * group_rows + r;
          __m512 sc[NR];
          fp8_scores_from_rows<NR>(&s.qrows[r0 * D], D, k, p.slot_stride, n, sc);
          for (int j = 0; j < NR; ++j) {
            const __mmask16 keep = visible_keys(n, s.qpos[r0 + j], key0, p.window);
            _mm512_storeu_ps(&s.scores[(r0 + j) * LD + key0 - seg],
                             _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), keep, sc[j], _mm512_set1_ps(scale)));
          }
        });
      });
      const int len = seg_hi - seg;
      for (int r = 0; r < num_rows; ++r) {  // the rows' maxima; what they had so far rescaled
        __m512 mx = _mm512_set1_ps(NEG_INF);
        const float* sr = &s.scores[r * LD];
        for (int j = 0; j < len; j += 16) {
          const __mmask16 in = len - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - j)) - 1);
          mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), in, sr + j));
        }
        const float m = std::max(rows.m[r], _mm512_reduce_max_ps(mx));
        if (m == rows.m[r] || rows.m[r] == NEG_INF) {
          rows.m[r] = m;
          continue;
        }
        const float alpha = std::exp(rows.m[r] - m);
        for (int d = 0; d < D; d += 16)
          _mm512_storeu_ps(rows.o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(rows.o + r * D + d), _mm512_set1_ps(alpha)));
        for (int j = 0; j < 16; ++j) s.sums[r * 16 + j] *= alpha;
        rows.l[r] *= alpha;
        rows.m[r] = m;
      }
      each_chunk(seg, seg_hi, p.v, [&](int key0, int n, int64_t slot, int h) {  // the probabilities and values
        const C* v = p.v + slot * p.slot_stride + h * D;
        const __mmask16 in = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
        in_row_blocks(group_rows, [&](auto nr, int r) {
          constexpr int NR = decltype(nr)::value;
          const int r0 = h * group_rows + r;
          alignas(64) uint16_t pb[NR * 16];
          for (int j = 0; j < NR; ++j) {
            const float m = rows.m[r0 + j];
            __m512 e = _mm512_setzero_ps();
            if (m != NEG_INF) {
              const __m512 x = _mm512_maskz_loadu_ps(in, &s.scores[(r0 + j) * LD + key0 - seg]);
              e = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m))));
            }
            float* sum = &s.sums[(r0 + j) * 16];
            _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_loadu_ps(sum), e));
            _mm256_store_si256(reinterpret_cast<__m256i*>(pb + j * 16),
                               (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, _mm512_set1_ps(FP8_UP))));
          }
          fp8_values<NR>(reinterpret_cast<const uint32_t*>(pb), v, p.slot_stride, n, D, rows.o + r0 * D);
        });
      });
    }
    for (int r = 0; r < num_rows; ++r) rows.l[r] += _mm512_reduce_add_ps(_mm512_loadu_ps(&s.sums[r * 16]));
    unpermute_rows(rows.o, num_rows, D, s.row.data(), fp8_value_slot, FP8_UNDO<C>);
  }
};

}  // namespace atom::attention
