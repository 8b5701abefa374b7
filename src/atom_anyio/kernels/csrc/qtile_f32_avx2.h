// The AVX2 variant of the float32 linears over quantized tiles (qtile_f32.cpp): the same chain per
// output element as the portable twin, eight columns to a register.
//
// A tile row r holds dims 2r and 2r + 1 of the tile's 16 columns; row_weights turns it into four
// registers of weights (columns 0-7 and 8-15, each dim), dequantized exactly as the reference does
// (quant.py: d q + m, d (q - 8), d q; d q is exact, so an FMA rounds as the two steps do; Q4_K's
// s q + m and Q6_K's s q alike, with float32 scales).
//
// 1-4 rows (decodes): gemv_tiles, the tiles streaming once, dequantized in registers, each row of x
// against one or two column blocks at a time (four to eight FMA chains in flight). More: gemm_tiles,
// an outer-product GEMM (BLIS's 6 x 16 micro-kernel): a column block's tiles dequantized once per K
// block of up to 256 dims into a panel that stays in L1 while every six rows of x (packed, dim-major)
// pass over it, the accumulators in `out` between K blocks (a float stored and loaded is the same
// float). Each output element is one chain either way: zero, then fma(x[k], w[k], acc) for k in
// order, then the bias: batch-invariant by construction.
#pragma once

#if !(defined(__AVX2__) && defined(__FMA__))
#error "qtile_f32_avx2.h needs a build that targets AVX2 and FMA"
#endif

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace atom::qtile_avx2 {

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// a tile's 16 scales d and (Q4_1) offsets m as floats, columns 0-7 and 8-15
struct Scales {
  __m256 d[2], m[2];
};

template <int64_t Type>
inline Scales tile_scales(const uint8_t* tile) {
  const uint8_t* s = tile + q_scales_at(Type);
  Scales sc;
  if constexpr (is_k_quant(Type)) {  // float32: s and m (Q4_K), or the two halves' s (Q6_K)
    const float* f = reinterpret_cast<const float*>(s);
    for (int h = 0; h < 2; ++h) sc.d[h] = _mm256_loadu_ps(f + 8 * h), sc.m[h] = _mm256_loadu_ps(f + 16 + 8 * h);
    return sc;
  }
  for (int h = 0; h < 2; ++h) {
    sc.d[h] = _mm256_cvtph_ps(load16(s + 16 * h));
    sc.m[h] = Type == Q4_1 ? _mm256_cvtph_ps(load16(s + 32 + 16 * h)) : _mm256_setzero_ps();
  }
  return sc;
}

// tile row r's weights: w[h][t] holds columns 8h .. 8h + 7 of dim 2r + t
template <int64_t Type>
inline void row_weights(const uint8_t* tile, int r, const Scales& sc, __m256 w[2][2]) {
  if constexpr (Type == Q8_0 || Type == Q6_K) {
    const __m256* d = Type == Q6_K && r >= 8 ? sc.m : sc.d;  // Q6_K: dims 16-31's own scales
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // a column's two int8 side by side: one int32 lane per column
      const __m256i v = _mm256_cvtepi8_epi16(load16(tile + r * 32 + 16 * h));
      w[h][0] = _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16)));
      w[h][1] = _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16)));
    }
  } else {
    const __m128i b = load16(tile + r * 16);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i z = _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(b, b) : b);
      __m256i q0 = _mm256_and_si256(z, _mm256_set1_epi32(15)), q1 = _mm256_srli_epi32(z, 4);
      if constexpr (Type == Q4_0) {
        q0 = _mm256_sub_epi32(q0, _mm256_set1_epi32(8)), q1 = _mm256_sub_epi32(q1, _mm256_set1_epi32(8));
        w[h][0] = _mm256_mul_ps(sc.d[h], _mm256_cvtepi32_ps(q0));
        w[h][1] = _mm256_mul_ps(sc.d[h], _mm256_cvtepi32_ps(q1));
      } else {
        w[h][0] = _mm256_fmadd_ps(sc.d[h], _mm256_cvtepi32_ps(q0), sc.m[h]);
        w[h][1] = _mm256_fmadd_ps(sc.d[h], _mm256_cvtepi32_ps(q1), sc.m[h]);
      }
    }
  }
}

// eight accumulated columns (+ bias) into out, the first `cols` of them
inline void store_columns(float* out, __m256 acc, const float* bias, int64_t cols) {
  if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias));  // bias padded to the blocks (qtile_f32.cpp)
  if (cols >= 8) return _mm256_storeu_ps(out, acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  std::copy_n(lanes, std::max<int64_t>(cols, 0), out);
}

// M rows' accumulators of T column blocks (+ bias) into out, the first `cols` columns
template <int M, int T>
inline void store_accumulators(const __m256 (&acc)[M][T][2], float* out, int64_t ldo, int64_t cols,
                               const float* bias) {
#pragma GCC unroll 4
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int64_t c = 16 * t + 8 * h;
        store_columns(out + i * ldo + c, acc[i][t][h], bias ? bias + c : nullptr, cols - c);
      }
}

// the GEMVs' column blocks over the threads, four at a time for one row of x, two for two, one for more
// (eight FMA chains in flight at most; four blocks for one row measured level with two): run(nb, T) for
// each run of T blocks from nb (std::integral_constant), a last short run a block at a time
template <int M, typename Run>
void over_column_blocks(int64_t NB, const Run& run) {
  constexpr int T = M == 1 ? 4 : M == 2 ? 2 : 1;
  at::parallel_for(0, (NB + T - 1) / T, 4, [&](int64_t b, int64_t e) {
    for (int64_t nb = b * T; nb < std::min(NB, e * T); nb += T) {
      if (nb + T <= NB)
        run(nb, std::integral_constant<int, T>{});
      else
        for (int64_t j = nb; j < NB; ++j) run(j, std::integral_constant<int, 1>{});
    }
  });
}

// M rows of x against T column blocks (each KB tiles of `tb` bytes, one after another), `cols` valid
// columns from out's first
// (`#pragma GCC unroll` on the small loops: unrolled early, GCC 12 keeps the arrays of accumulators in
// registers; left to -O3's later unrolling it stores them on every step)
template <int64_t Type, int M, int T>
void gemv_tiles(const float* x, int64_t K, const uint8_t* w, int64_t KB, int64_t tb, float* out, int64_t ldo,
                int64_t cols, const float* bias) {
  __m256 acc[M][T][2] = {};  // zeros
  for (int64_t kb = 0; kb < KB; ++kb) {
    Scales sc[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) sc[t] = tile_scales<Type>(w + (t * KB + kb) * tb);
    for (int r = 0; r < 16; ++r) {
      const int64_t k = kb * 32 + 2 * r;
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        __m256 wr[2][2];
        row_weights<Type>(w + (t * KB + kb) * tb, r, sc[t], wr);
#pragma GCC unroll 4
        for (int i = 0; i < M; ++i) {
          const __m256 x0 = _mm256_broadcast_ss(x + i * K + k), x1 = _mm256_broadcast_ss(x + i * K + k + 1);
          acc[i][t][0] = _mm256_fmadd_ps(x0, wr[0][0], acc[i][t][0]);
          acc[i][t][1] = _mm256_fmadd_ps(x0, wr[1][0], acc[i][t][1]);
          acc[i][t][0] = _mm256_fmadd_ps(x1, wr[0][1], acc[i][t][0]);
          acc[i][t][1] = _mm256_fmadd_ps(x1, wr[1][1], acc[i][t][1]);
        }
      }
    }
  }
  store_accumulators<M, T>(acc, out, ldo, cols, bias);
}

// one to four rows of x over the column blocks
template <int64_t Type, int M>
void gemv_rows(const float* x, int64_t K, const uint8_t* w, int64_t NB, int64_t KB, int64_t tb, float* out,
               int64_t N, const float* bias) {
  over_column_blocks<M>(NB, [&](int64_t nb, auto blocks) {
    gemv_tiles<Type, M, decltype(blocks)::value>(x, K, w + nb * KB * tb, KB, tb, out + nb * 16, N, N - nb * 16,
                                                 bias ? bias + nb * 16 : nullptr);
  });
}

constexpr int MR = 6, KC_TILES = 8;  // rows of x per micro-kernel; tiles per K block (a 16 KB panel)

// six rows of x (packed: per dim, the six rows' values) against a panel of 16 columns (per dim, the
// columns' weights) over kc dims: the chains start at zero (`first`) or from out, and end in out, with
// the bias at the end (`bias`, on the last K block)
inline void micro_kernel(const float* xp, const float* panel, int64_t kc, float* out, int64_t ldo, bool first,
                         const float* bias) {
  struct Row {  // a row's 16 accumulators; six named rows, not an array: GCC 12 keeps an array's in memory
    __m256 lo, hi;
  };
  auto start = [&](int m) -> Row {
    if (first) return {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return {_mm256_loadu_ps(out + m * ldo), _mm256_loadu_ps(out + m * ldo + 8)};
  };
  Row r0 = start(0), r1 = start(1), r2 = start(2), r3 = start(3), r4 = start(4), r5 = start(5);
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * 16), b1 = _mm256_loadu_ps(panel + k * 16 + 8);
    auto step = [&](Row& r, int m) {
      const __m256 a = _mm256_broadcast_ss(xp + k * MR + m);
      r.lo = _mm256_fmadd_ps(a, b0, r.lo), r.hi = _mm256_fmadd_ps(a, b1, r.hi);
    };
    step(r0, 0), step(r1, 1), step(r2, 2), step(r3, 3), step(r4, 4), step(r5, 5);
  }
  auto finish = [&](const Row& r, int m) {
    _mm256_storeu_ps(out + m * ldo, bias ? _mm256_add_ps(r.lo, _mm256_loadu_ps(bias)) : r.lo);
    _mm256_storeu_ps(out + m * ldo + 8, bias ? _mm256_add_ps(r.hi, _mm256_loadu_ps(bias + 8)) : r.hi);
  };
  finish(r0, 0), finish(r1, 1), finish(r2, 2), finish(r3, 3), finish(r4, 4), finish(r5, 5);
}

// the same into `rows` rows and `cols` columns of out, through a whole tile beside it where they fall short
inline void micro_kernel_edge(const float* xp, const float* panel, int64_t kc, float* out, int64_t ldo, int rows,
                              int64_t cols, bool first, const float* bias) {
  if (rows == MR && cols == 16) return micro_kernel(xp, panel, kc, out, ldo, first, bias);
  alignas(32) float tile[MR * 16] = {};
  for (int m = 0; m < rows && !first; ++m) std::copy_n(out + m * ldo, cols, tile + m * 16);
  micro_kernel(xp, panel, kc, tile, 16, first, bias);
  for (int m = 0; m < rows; ++m) std::copy_n(tile + m * 16, cols, out + m * ldo);
}

// tiles [kb0, kb1) of one column block, dequantized into panel (per dim, the 16 columns)
template <int64_t Type>
void dequantize_panel(const uint8_t* block, int64_t kb0, int64_t kb1, int64_t tb, float* panel) {
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const uint8_t* tile = block + kb * tb;
    const Scales sc = tile_scales<Type>(tile);
    for (int r = 0; r < 16; ++r) {
      __m256 w[2][2];
      row_weights<Type>(tile, r, sc, w);
      float* dst = panel + ((kb - kb0) * 32 + 2 * r) * 16;
      _mm256_store_ps(dst, w[0][0]), _mm256_store_ps(dst + 8, w[1][0]);
      _mm256_store_ps(dst + 16, w[0][1]), _mm256_store_ps(dst + 24, w[1][1]);
    }
  }
}

// every six rows of x (packed once, dim-major) over each column block's panels of up to kc dims:
// `panel(nb, k0, k1, scratch)` gives block nb's weights for dims [k0, k1) as [k1 - k0][16] floats
// (dequantized into scratch, or where they lie); each thread takes a range of column blocks
template <typename Panel>
void gemm_panels(const float* x, int64_t M, int64_t K, int64_t NB, int64_t kc, float* out, int64_t N,
                 const float* bias, const Panel& panel) {
  const int64_t MT = (M + MR - 1) / MR;
  std::vector<float> xp(MT * K * MR);  // per six rows, per dim, the rows' values (zeros past M)
  at::parallel_for(0, MT, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int m = 0; m < MR; ++m) {
        const int64_t row = t * MR + m;
        float* dst = xp.data() + t * K * MR + m;
        for (int64_t k = 0; k < K; ++k) dst[k * MR] = row < M ? x[row * K + k] : 0.f;
      }
  });
  at::parallel_for(0, NB, 1, [&](int64_t b, int64_t e) {
    float* scratch = static_cast<float*>(std::aligned_alloc(64, kc * 16 * sizeof(float)));
    TORCH_CHECK(scratch, "tile linears (float32): no memory for a panel");
    for (int64_t nb = b; nb < e; ++nb) {
      const int64_t cols = std::min<int64_t>(16, N - nb * 16);
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = std::min(K, k0 + kc);
        const float* weights = panel(nb, k0, k1, scratch);
        const float* last_bias = k1 == K && bias ? bias + nb * 16 : nullptr;
        for (int64_t t = 0; t < MT; ++t)
          micro_kernel_edge(xp.data() + (t * K + k0) * MR, weights, k1 - k0, out + t * MR * N + nb * 16, N,
                            int(std::min<int64_t>(MR, M - t * MR)), cols, k0 == 0, last_bias);
      }
    }
    std::free(scratch);
  });
}

// out [M, N] = x [M, K] W^T (+ bias), W as NB column blocks of KB tiles of type Type; bias padded to NB * 16
template <int64_t Type>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t NB, int64_t KB, int64_t tb, float* out,
            int64_t N, const float* bias) {
  switch (M) {
    case 1: return gemv_rows<Type, 1>(x, K, w, NB, KB, tb, out, N, bias);
    case 2: return gemv_rows<Type, 2>(x, K, w, NB, KB, tb, out, N, bias);
    case 3: return gemv_rows<Type, 3>(x, K, w, NB, KB, tb, out, N, bias);
    case 4: return gemv_rows<Type, 4>(x, K, w, NB, KB, tb, out, N, bias);
  }
  const int64_t kblocks = (KB + KC_TILES - 1) / KC_TILES, kc_tiles = (KB + kblocks - 1) / kblocks;
  gemm_panels(x, M, K, NB, kc_tiles * 32, out, N, bias, [&](int64_t nb, int64_t k0, int64_t k1, float* scratch) {
    dequantize_panel<Type>(w + nb * KB * tb, k0 / 32, k1 / 32, tb, scratch);
    return static_cast<const float*>(scratch);
  });
}

// Float32 weights packed as panels (ops.pack_f32_tile_weight): [NB][K][16], block nb's 16 columns side by side
// for each dim, the last block's missing columns zero. The same chains: the GEMV reads a dim's 16 weights as two
// registers, the GEMM's panels are the packed weights as they lie.
template <int M, int T>
void gemv_panels(const float* x, int64_t K, const float* w, float* out, int64_t ldo, int64_t cols,
                 const float* bias) {
  __m256 acc[M][T][2] = {};  // zeros
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const __m256 w0 = _mm256_loadu_ps(w + (t * K + k) * 16), w1 = _mm256_loadu_ps(w + (t * K + k) * 16 + 8);
#pragma GCC unroll 4
      for (int i = 0; i < M; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
        acc[i][t][0] = _mm256_fmadd_ps(xv, w0, acc[i][t][0]);
        acc[i][t][1] = _mm256_fmadd_ps(xv, w1, acc[i][t][1]);
      }
    }
  }
  store_accumulators<M, T>(acc, out, ldo, cols, bias);
}

template <int M>
void gemv_panel_rows(const float* x, int64_t K, const float* w, int64_t NB, float* out, int64_t N, const float* bias) {
  over_column_blocks<M>(NB, [&](int64_t nb, auto blocks) {
    gemv_panels<M, decltype(blocks)::value>(x, K, w + nb * K * 16, out + nb * 16, N, N - nb * 16,
                                            bias ? bias + nb * 16 : nullptr);
  });
}

constexpr int64_t KC_DENSE = 256;  // dims per K block of the GEMM over float32 panels (16 KB)

inline void linear_dense(const float* x, int64_t M, int64_t K, const float* w, int64_t NB, float* out, int64_t N,
                         const float* bias) {
  switch (M) {
    case 1: return gemv_panel_rows<1>(x, K, w, NB, out, N, bias);
    case 2: return gemv_panel_rows<2>(x, K, w, NB, out, N, bias);
    case 3: return gemv_panel_rows<3>(x, K, w, NB, out, N, bias);
    case 4: return gemv_panel_rows<4>(x, K, w, NB, out, N, bias);
  }
  gemm_panels(x, M, K, NB, KC_DENSE, out, N, bias, [&](int64_t nb, int64_t k0, int64_t, float*) {
    return w + (nb * K + k0) * 16;
  });
}

}  // namespace atom::qtile_avx2
