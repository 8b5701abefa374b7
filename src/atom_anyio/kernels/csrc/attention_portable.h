// The portable variant of the paged attention (attention_loop.h's steps for any element type):
// a KV chunk is staged as float (K transposed, [D][16]) so the score and value micro-kernels
// are plain fixed-width FMA loops over rows held in registers (vec.h's V8: AVX2 where the
// build targets it, plain loops elsewhere). It is the twin every native variant is tested
// against (a call with native=false runs it). A build with AVX2 adds one step
// (attention_avx2.h): a decode's scores from the keys as they lie.
#pragma once

#include <vector>

#include "attention_loop.h"
#include "vec.h"

namespace atom::attention {

constexpr int RB = 6;  // rows per register block (12 accumulators)

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

// The scores of the portable variant: always from the staged keys
struct StagedScores {
  static constexpr bool FROM_KEYS = false;
};

// rows at or under this many per kv head take their scores from the keys as they lie (decodes;
// never a batch-invariant call, whose sums must not depend on the rows a block holds)
constexpr int ROWS_FROM_KEYS_MAX = 3;

// one chunk of keys [key0, key0 + n) for NR rows: scores, online softmax, values. kt: the chunk's
// keys staged transposed, or null to take the scores from the keys k as they lie (KeyScores)
template <int NR, bool Fixed, class KeyScores, typename T>
inline void rows_chunk(const float* q, int D, const float* kt, const T* k, int64_t ldk, const float* v, int64_t ldv,
                       int n, const int* qpos, int key0, int window, float* m, float* l, float* o) {
  V8 s[NR][2];
  float p[NR * KW];
  if constexpr (KeyScores::FROM_KEYS) {
    if (!kt)
      KeyScores::template scores<NR>(q, D, k, ldk, n, s);
    else
      scores<NR, Fixed>(q, D, kt, s);
  } else {
    scores<NR, Fixed>(q, D, kt, s);
  }
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

template <bool Fixed, class KeyScores, int NR = RB, typename T = float>
inline void rows_dispatch(int rows, const float* q, int D, const float* kt, const T* k, int64_t ldk, const float* v,
                          int64_t ldv, int n, const int* qpos, int key0, int window, float* m, float* l, float* o) {
  if constexpr (NR > 0) {
    if (!kt && NR > ROWS_FROM_KEYS_MAX) {
      rows_dispatch<Fixed, KeyScores, ROWS_FROM_KEYS_MAX>(rows, q, D, kt, k, ldk, v, ldv, n, qpos, key0, window, m, l,
                                                          o);
      return;
    }
    if (rows >= NR) {
      rows_chunk<NR, Fixed, KeyScores>(q, D, kt, k, ldk, v, ldv, n, qpos, key0, window, m, l, o);
      rows_dispatch<Fixed, KeyScores, NR>(rows - NR, q + NR * D, D, kt, k, ldk, v, ldv, n, qpos + NR, key0, window,
                                          m + NR, l + NR, o + NR * D);
    } else {
      rows_dispatch<Fixed, KeyScores, NR - 1>(rows, q, D, kt, k, ldk, v, ldv, n, qpos, key0, window, m, l, o);
    }
  }
}

// The float variant for element type T and cache type C (T, or fp8: read as float, exactly):
// queries scaled as float, keys staged transposed (or, with KeyScores::FROM_KEYS, read as they lie
// for a decode's rows), values read as float.
template <typename T, typename C, class KeyScores>
struct FloatVariant : Chunked<FloatVariant<T, C, KeyScores>, T, C> {
  static constexpr bool SCORES_FROM_KEYS = KeyScores::FROM_KEYS;
  using P = Problem<T, C>;

  struct Scratch : ChunkedScratch {
    std::vector<float> qs, kt, vb;  // the rows scaled; a chunk's keys transposed; its values as float
    Scratch(const P& p, int max_rows) : ChunkedScratch(max_rows), qs(max_rows * p.D), kt(p.D * KW), vb(KW * p.D) {}
  };

  static void load_query(Scratch& s, const P& p, int r, const T* q) {
    for (int d = 0; d < p.D; ++d) s.qs[r * p.D + d] = float(q[d]) * p.scale;
  }

  static void stage_keys(Scratch& s, const P& p, const C* k, int n) {
    attention::stage_keys(k, p.slot_stride, n, p.D, s.kt.data());
  }

  static void step(Scratch& s, const P& p, const Chunk<C>& c, int r0, int count, bool staged, Rows rows) {
    const int D = p.D;
    const float* v;
    int64_t ldv;
    if constexpr (std::is_same_v<C, float>) {
      v = c.v;
      ldv = p.slot_stride;
    } else {
      for (int j = 0; j < c.n; ++j)
        for (int d = 0; d < D; d += 8) store(&s.vb[j * D + d], load_as_float(c.v + j * p.slot_stride + d));
      v = s.vb.data();
      ldv = D;
    }
    if (p.partition > 0)
      rows_dispatch<true, KeyScores>(count, &s.qs[r0 * D], D, s.kt.data(), c.k, p.slot_stride, v, ldv, c.n,
                                     &s.qpos[r0], c.key0, p.window, rows.m + r0, rows.l + r0, rows.o + r0 * D);
    else
      rows_dispatch<false, KeyScores>(count, &s.qs[r0 * D], D, staged ? s.kt.data() : nullptr, c.k, p.slot_stride, v,
                                      ldv, c.n, &s.qpos[r0], c.key0, p.window, rows.m + r0, rows.l + r0,
                                      rows.o + r0 * D);
  }

  static void finish(Scratch&, const P&, int, float*) {}  // the outputs are in dim order
};

template <typename T, typename C = T>
using Portable = FloatVariant<T, C, StagedScores>;

}  // namespace atom::attention
