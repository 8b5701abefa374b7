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
// With AVX512-BF16 and a bfloat16 cache, keys are staged as bfloat16 pairs
// and both products are pair dot products (vdpbf16ps). The next chunks are
// prefetched in pieces between the current chunk's work (struct Ahead).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <vector>

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

// one chunk of keys [key0, key0 + n) for NR rows: scores, online softmax, values
template <int NR, bool Fixed>
inline void rows_chunk(const float* q, int D, const float* kt, const float* v, int64_t ldv, int n, const int* qpos,
                       int key0, int window, float* m, float* l, float* o) {
  V8 s[NR][2];
  float p[NR * KW];
  scores<NR, Fixed>(q, D, kt, s);
  for (int r = 0; r < NR; ++r) {
    const int visible = std::min(n, qpos[r] - key0 + 1);  // causal: keys up to the row's own position
    V8 s0 = mask_from(s[r][0], visible), s1 = mask_from(s[r][1], visible - 8);
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
    const float alpha = m[r] == NEG_INF ? 0.f : std::exp(m[r] - mx);
    l[r] = l[r] * alpha + hsum(add(e0, e1));
    m[r] = mx;
    if (alpha != 1.f)
      for (int d = 0; d < D; d += 8) store(o + r * D + d, mul(load(o + r * D + d), splat(alpha)));
  }
  values<NR, Fixed>(p, v, ldv, n, D, o);
}

template <bool Fixed, int NR = RB>
inline void rows_dispatch(int rows, const float* q, int D, const float* kt, const float* v, int64_t ldv, int n,
                          const int* qpos, int key0, int window, float* m, float* l, float* o) {
  if constexpr (NR > 0) {
    if (rows >= NR) {
      rows_chunk<NR, Fixed>(q, D, kt, v, ldv, n, qpos, key0, window, m, l, o);
      rows_dispatch<Fixed, NR>(rows - NR, q + NR * D, D, kt, v, ldv, n, qpos + NR, key0, window, m + NR, l + NR,
                               o + NR * D);
    } else {
      rows_dispatch<Fixed, NR - 1>(rows, q, D, kt, v, ldv, n, qpos, key0, window, m, l, o);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ATOM_AVX512_BF16 1
#endif

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
inline void bf16_rows_chunk(const uint32_t* q, int P, const uint32_t* kp, const c10::BFloat16* v, int64_t ldv, int n,
                            const int* qpos, int key0, int window, float scale, float* m, float* l, float* o) {
  const int D = 2 * P;
  __m512 s[NR], s2[NR];
  for (int r = 0; r < NR; ++r) s[r] = s2[r] = _mm512_setzero_ps();
  for (int p = 0; p < P; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * 16), k1 = (__m512bh)_mm512_loadu_si512(kp + p * 16 + 16);
    for (int r = 0; r < NR; ++r) {
      s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(q[r * P + p]), k0);
      s2[r] = _mm512_dpbf16_ps(s2[r], (__m512bh)_mm512_set1_epi32(q[r * P + p + 1]), k1);
    }
  }
  alignas(64) uint16_t pb[NR * 16];  // the probabilities as bfloat16, two keys per dword
  for (int r = 0; r < NR; ++r) {
    const int visible = std::min(n, qpos[r] - key0 + 1);  // causal: keys up to the row's own position
    __mmask16 keep = visible <= 0 ? 0 : __mmask16((1u << visible) - 1);
    if (window > 0) {  // sliding window: keys after the row's position - window
      const int first = qpos[r] - window + 1 - key0;
      if (first > 0) keep &= first >= 16 ? 0 : __mmask16(~((1u << first) - 1));
    }
    const __m512 sr = _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), keep, _mm512_add_ps(s[r], s2[r]), _mm512_set1_ps(scale));
    const float mx = std::max(m[r], _mm512_reduce_max_ps(sr));
    if (mx == NEG_INF) {  // nothing visible yet for this row
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 16), _mm256_setzero_si256());
      continue;
    }
    const __m512 e = exp16(_mm512_sub_ps(sr, _mm512_set1_ps(mx)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 16), (__m256i)_mm512_cvtneps_pbh(e));
    const float alpha = m[r] == NEG_INF ? 0.f : std::exp(m[r] - mx);
    l[r] = l[r] * alpha + _mm512_reduce_add_ps(e);
    m[r] = mx;
    if (alpha != 1.f)
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), _mm512_set1_ps(alpha)));
  }
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

template <int NR = NB>
inline void bf16_rows_dispatch(int rows, const uint32_t* q, int P, const uint32_t* kp, const c10::BFloat16* v,
                               int64_t ldv, int n, const int* qpos, int key0, int window, float scale, float* m,
                               float* l, float* o) {
  if constexpr (NR > 0) {
    for (; rows >= NR; rows -= NR, q += NR * P, qpos += NR, m += NR, l += NR, o += NR * 2 * P)
      bf16_rows_chunk<NR>(q, P, kp, v, ldv, n, qpos, key0, window, scale, m, l, o);
    if (rows > 0) bf16_rows_dispatch<NR - 1>(rows, q, P, kp, v, ldv, n, qpos, key0, window, scale, m, l, o);
  }
}
#endif

// whether the native variants run (atom::set_native_kernels turns them off, to compare with the portable twin)
bool g_native = true;

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
  const int tile = std::max(1, 36 / G);
  const int window = int(sliding_window);  // 0: the whole causal context
  std::vector<Unit> units;
  int max_span = 0;
  for (int b = 0; b < B; ++b) {
    const int nq = qstart[b + 1] - qstart[b], first_pos = lens[b] - nq;
    for (int i = 0; i < nq; i += tile) {
      const int q_end = std::min(nq, i + tile), hi = first_pos + q_end;  // causal bound of the tile
      const int lo = window > 0 ? std::max(0, first_pos + i - window + 1) / BS * BS : 0;  // chunks before: skipped
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
  // one task per item when the units alone cannot keep the threads busy, else one per unit
  // (its partitions in order, merged in the task: no partials kept for the whole step)
  const bool per_item = merged && num_units < 4 * threads;
  std::vector<float> partial_o, partial_ml;
  if (per_item) {
    partial_o.assign(items.size() * max_rows * D, 0.f);
    partial_ml.assign(items.size() * max_rows * 2, 0.f);
  }
  auto out_row = [&](const Unit& u, int nt, int r) {
    const int h = r / (nt * G), i = u.q_begin + (r / G) % nt, g = r % G;
    return op + (int64_t(qstart[u.seq] + i) * H + h * G + g) * D;
  };
  // the sink's term of the softmax denominator (relative to the row's running max mx), 0 without sinks
  auto sink_term = [&](int nt, int r, float mx) {
    return sinks ? std::exp(sinks[r / (nt * G) * G + r % G] - mx) : 0.f;
  };
  // a unit's rows from its `count` partials (ml: [count][max_rows][2], o: [count][max_rows][D])
  auto merge = [&](const Unit& u, int count, const float* ml, const float* po, float* acc) {
    const int nt = u.q_end - u.q_begin;
    for (int r = 0; r < nt * H; ++r) {
      float mx = NEG_INF;
      for (int s = 0; s < count; ++s) mx = std::max(mx, ml[(s * max_rows + r) * 2]);
      std::fill(acc, acc + D, 0.f);
      float sum = 0.f;
      for (int s = 0; s < count; ++s) {
        const size_t base = size_t(s) * max_rows + r;
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
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(max_rows * D), o(max_rows * D), kt(D * KW), vb(KW * D), m(max_rows), l(max_rows), acc(D);
    std::vector<float> unit_o, unit_ml;  // a unit's partials, when its task merges them
    std::vector<int> qpos(max_rows);
    constexpr bool is_bf16 = std::is_same_v<T, c10::BFloat16>;
#ifdef ATOM_AVX512_BF16
    const bool native = is_bf16 && g_native;
    std::vector<uint32_t> qpairs(native ? max_rows * D / 2 : 0), kpairs(native ? D / 2 * 16 : 0);
#endif
    // rows' m, l, o over keys [key_lo, key_hi) of unit u
    auto attend = [&](const Unit& u, int key_lo, int key_hi) {
      const int first_pos = lens[u.seq] - (qstart[u.seq + 1] - qstart[u.seq]);
      const int nt = u.q_end - u.q_begin, rows = nt * H, group_rows = nt * G;
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
      std::fill(o.begin(), o.begin() + rows * D, 0.f);
      std::fill(m.begin(), m.begin() + rows, NEG_INF);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int* table = tables + int64_t(u.seq) * max_blocks;
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
              stage_key_pairs(kb, slot_stride, n, D / 2, kpairs.data());
              ak.issue(h + 1 < KVH ? piece : ak.left);
              av.issue(piece);
              bf16_rows_dispatch(group_rows, &qpairs[r0 * D / 2], D / 2, kpairs.data(), vsrc, slot_stride, n, &qpos[r0],
                                 key0, window, float(scale), &m[r0], &l[r0], &o[r0 * D]);
              av.issue(h + 1 < KVH ? piece : av.left);
              continue;
            }
          }
#endif
          stage_keys(kb, slot_stride, n, D, kt.data());
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
            rows_dispatch<true>(group_rows, &qs[r0 * D], D, kt.data(), v, ldv, n, &qpos[r0], key0, window, &m[r0],
                                &l[r0], &o[r0 * D]);
          else
            rows_dispatch<false>(group_rows, &qs[r0 * D], D, kt.data(), v, ldv, n, &qpos[r0], key0, window, &m[r0],
                                 &l[r0], &o[r0 * D]);
          av.issue(h + 1 < KVH ? piece : av.left);
        }
      }
#ifdef ATOM_AVX512_BF16
      if (native) unpermute_rows(o.data(), rows, D, acc.data());
#endif
    };
    // a partial (unnormalised output, running max and sum) into ml/po at slot s
    auto keep = [&](int rows, float* ml, float* po, int s) {
      std::copy(o.begin(), o.begin() + rows * D, po + size_t(s) * max_rows * D);
      for (int r = 0; r < rows; ++r) {
        ml[(size_t(s) * max_rows + r) * 2] = m[r];
        ml[(size_t(s) * max_rows + r) * 2 + 1] = l[r];
      }
    };
    for (int64_t task = begin; task < end; ++task) {
      if (per_item) {
        const Item& it = items[task];
        attend(units[it.unit], it.key_lo, it.key_hi);
        keep((units[it.unit].q_end - units[it.unit].q_begin) * H, partial_ml.data(), partial_o.data(), int(task));
        continue;
      }
      const Unit& u = units[task];
      const int nt = u.q_end - u.q_begin, rows = nt * H, count = first_item[task + 1] - first_item[task];
      if (merged) {
        unit_o.resize(size_t(count) * max_rows * D);
        unit_ml.resize(size_t(count) * max_rows * 2);
        for (int s = 0; s < count; ++s) {
          const Item& it = items[first_item[task] + s];
          attend(u, it.key_lo, it.key_hi);
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
      merge(units[ui], first_item[ui + 1] - first_item[ui], partial_ml.data() + first * max_rows * 2,
            partial_o.data() + first * max_rows * D, acc.data());
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

TORCH_LIBRARY(atom, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start, int block_size, float scale, int sliding_window=0, "
      "Tensor? sinks=None, int partition=0) -> ()");
  m.def("native_kernels() -> str[]", &native_kernels);
  m.def("set_native_kernels(bool enabled) -> bool", &set_native_kernels);
}

TORCH_LIBRARY_IMPL(atom, CPU, m) { m.impl("paged_attention", &paged_attention); }
