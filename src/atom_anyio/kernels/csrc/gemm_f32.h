// The float32 GEMV/GEMM: out [M, N] = x [M, K] W^T (+ bias) for any M, each output element by one
// arithmetic whatever M is, so batch-invariant by construction: eight lanes, lane j an FMA chain over
// k = j, j + 8, ... in order from zero, then vec.h's horizontal sum, then the bias (ops.cpp's gemv op;
// GGUF blocks have quant.cpp's own int16 GEMV and GEMM).
//
// 1-4 rows (decodes): gemv_block, W's rows streaming once. More: the rows four at a time through the same
// blocks, W in chunks that stay in cache; where the CPU has AVX512, two rows of x side by side in one
// register against W's rows broadcast to both halves (each half the same eight-lane chain, ending in
// the same horizontal sum: the same bits, twice the work per instruction), x in tiles that stay in L1
// with K in blocks (the accumulators kept between them: a float stored and loaded is the same float).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

namespace atom::gemm {

// R consecutive rows of W (`w`, K apart) against the M rows of x; K is a multiple of 8
template <int M, int R>
inline void gemv_block(const float* x, int64_t K, const float* w, float* out, int64_t ldo, const float* bias) {
  V8 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = splat(0.f);
  for (int64_t k = 0; k < K; k += 8) {
    V8 wr[R];
    for (int r = 0; r < R; ++r) wr[r] = load(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const V8 xv = load(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = fma(xv, wr[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * ldo + r] = hsum(acc[m][r]) + (bias ? bias[r] : 0.f);
}

// `n` rows of W from `w` against M (1-4) rows of x; out and bias at the first of them
template <int M>
inline void gemv_rows(const float* x, int64_t K, const float* w, int64_t n, float* out, int64_t ldo,
                      const float* bias) {
  constexpr int R = M == 1 ? 4 : 2;  // weight rows per block: independent FMA chains, within 16 registers
  int64_t r = 0;
  for (; r + R <= n; r += R) gemv_block<M, R>(x, K, w + r * K, out + r, ldo, bias ? bias + r : nullptr);
  for (; r < n; ++r) gemv_block<M, 1>(x, K, w + r * K, out + r, ldo, bias ? bias + r : nullptr);
}

// any number of rows of x against `n` rows of W, four rows of x at a time
inline void gemv_any(const float* x, int64_t M, int64_t K, const float* w, int64_t n, float* out, int64_t ldo,
                     const float* bias) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) gemv_rows<4>(x + m * K, K, w, n, out + m * ldo, ldo, bias);
  switch (M - m) {
    case 3: gemv_rows<3>(x + m * K, K, w, n, out + m * ldo, ldo, bias); break;
    case 2: gemv_rows<2>(x + m * K, K, w, n, out + m * ldo, ldo, bias); break;
    case 1: gemv_rows<1>(x + m * K, K, w, n, out + m * ldo, ldo, bias); break;
  }
}

#ifdef ATOM_ELEMENTWISE_AVX512
// P pairs of rows (x packed as pairs: row 2p's eight floats then row 2p + 1's, per step of 8 along K)
// against R rows of W over K's block [k0, k0 + kc): the accumulators start at zero (first block) or
// from `acc_mem`, and end in `acc_mem` or (last block) in out
template <int P, int R>
void tile16(const float* xpairs, int64_t K, const float* w, int64_t k0, int64_t kc, __m512* acc_mem, bool first,
            bool last, float* out, int64_t ldo, const float* bias, int rows) {
  __m512 acc[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) acc[p][r] = first ? _mm512_setzero_ps() : acc_mem[p * R + r];
  for (int64_t k = k0; k < k0 + kc; k += 8) {
    __m512 wr[R];
    for (int r = 0; r < R; ++r) wr[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(w + r * K + k));
    for (int p = 0; p < P; ++p) {
      const __m512 xv = _mm512_loadu_ps(xpairs + p * 2 * K + 2 * k);
      for (int r = 0; r < R; ++r) acc[p][r] = _mm512_fmadd_ps(xv, wr[r], acc[p][r]);
    }
  }
  if (!last) {
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) acc_mem[p * R + r] = acc[p][r];
    return;
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2 && 2 * p + h < rows; ++h) {
        const V8 half = {h ? _mm512_extractf32x8_ps(acc[p][r], 1) : _mm512_castps512_ps256(acc[p][r])};
        out[(2 * p + h) * ldo + r] = hsum(half) + (bias ? bias[r] : 0.f);
      }
}

using Tile16 = void (*)(const float*, int64_t, const float*, int64_t, int64_t, __m512*, bool, bool, float*, int64_t,
                        const float*, int);
template <int P>
inline constexpr Tile16 TILES16_ROW[4] = {tile16<P, 1>, tile16<P, 2>, tile16<P, 3>, tile16<P, 4>};
// [pairs - 1][rows of W - 1]
inline constexpr const Tile16* TILES16[6] = {TILES16_ROW<1>, TILES16_ROW<2>, TILES16_ROW<3>,
                                             TILES16_ROW<4>, TILES16_ROW<5>, TILES16_ROW<6>};
inline constexpr int P16 = 6, R16 = 4;  // 24 accumulators, 4 rows of W and a pair of x: 29 of the 32 registers

// rows [0, rows) of x as pairs (an odd last row paired with zeros): pair p at dst + p * 2 K
inline void pack_pairs(const float* x, int64_t K, int64_t rows, float* dst) {
  for (int64_t p = 0; p < (rows + 1) / 2; ++p)
    for (int64_t k = 0; k < K; k += 8) {
      std::memcpy(dst + p * 2 * K + 2 * k, x + 2 * p * K + k, 8 * sizeof(float));
      if (2 * p + 1 < rows)
        std::memcpy(dst + p * 2 * K + 2 * k + 8, x + (2 * p + 1) * K + k, 8 * sizeof(float));
      else
        std::memset(dst + p * 2 * K + 2 * k + 8, 0, 8 * sizeof(float));
    }
}

// x's pairs (packed) against `n` rows of W from `w`: each tile of P16 pairs (in L1, K in blocks of up to
// 512) passes over W's rows, R16 at a time; `acc` holds a tile's accumulators between K's blocks
inline void gemm16_rows(const float* packed, int64_t M, int64_t K, const float* w, int64_t n, float* out,
                        int64_t ldo, const float* bias, std::vector<__m512>& acc) {
  const int64_t pairs = (M + 1) / 2, kblocks = (K + 511) / 512, kc = (K / 8 + kblocks - 1) / kblocks * 8;
  if (kblocks > 1) acc.resize(std::max<size_t>(acc.size(), (n + R16 - 1) / R16 * P16 * R16));
  for (int64_t p = 0; p < pairs; p += P16) {
    const int np = int(std::min<int64_t>(P16, pairs - p));
    const int rows = int(std::min<int64_t>(2 * np, M - 2 * p));
    const float* xs = packed + p * 2 * K;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t len = std::min(kc, K - k0);
      for (int64_t r = 0; r < n; r += R16) {
        const int nr = int(std::min<int64_t>(R16, n - r));
        TILES16[np - 1][nr - 1](xs, K, w + r * K, k0, len, acc.data() + r / R16 * P16 * R16, k0 == 0, k0 + len >= K,
                                out + 2 * p * ldo + r, ldo, bias ? bias + r : nullptr, rows);
      }
    }
  }
}
#endif

// The driver over W [N, K]: each thread takes a range of W's rows; past four rows of x, in chunks that stay
// in cache (~256 KB) while every row of x passes over each
inline void gemm(float* out, const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias) {
  const int64_t chunk = M <= 4 ? N : std::max<int64_t>(4, (int64_t(256) << 10) / (K * int64_t(sizeof(float))));
#ifdef ATOM_ELEMENTWISE_AVX512
  if (M > 4) {
    const int64_t pairs = (M + 1) / 2, step = std::max<int64_t>(R16, chunk / R16 * R16);
    std::vector<float> packed(pairs * 2 * K);
    at::parallel_for(0, pairs, 16, [&](int64_t b, int64_t e) {
      pack_pairs(x + 2 * b * K, K, std::min(M, 2 * e) - 2 * b, packed.data() + b * 2 * K);
    });
    at::parallel_for(0, (N + R16 - 1) / R16, 4, [&](int64_t b, int64_t e) {
      std::vector<__m512> acc;
      for (int64_t c0 = b * R16, hi = std::min(N, e * R16); c0 < hi; c0 += step) {
        const int64_t c1 = std::min(hi, c0 + step);
        gemm16_rows(packed.data(), M, K, w + c0 * K, c1 - c0, out + c0, N, bias ? bias + c0 : nullptr, acc);
      }
    });
    return;
  }
#endif
  const int64_t step = std::max<int64_t>(4, chunk / 4 * 4);
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t b, int64_t e) {
    for (int64_t c0 = b * 4, hi = std::min(N, e * 4); c0 < hi; c0 += step) {
      const int64_t c1 = std::min(hi, c0 + step);
      gemv_any(x, M, K, w + c0 * K, c1 - c0, out + c0, N, bias ? bias + c0 : nullptr);
    }
  });
}

}  // namespace atom::gemm
