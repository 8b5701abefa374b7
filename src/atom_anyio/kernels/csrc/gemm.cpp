// Bfloat16 linears over weights packed as B tiles: out [M, N] = x [M, K] W^T (+ bias), for any M,
// on the AMX tiles where the CPU has them (and cpu_amx is on), else on AVX512-BF16's pair dot
// products (a Zen 4 or 5), both reading the same packed weight.
//
// The weight is packed once (ops.py: pack_tile_weight) as B tiles, [N/16][K/32][16][32]: tile
// (nb, kb) holds columns nb*16 .. +15 as rows of dim pairs (row r: k = kb*32 + 2r, 2r+1 of each
// of the 16 columns), 1 KB each, the tiles of one column block contiguous along K. On AMX a tile
// of 16 rows of x is the A tile, straight from x (the last block's rows copied beside zeros).
//
// Every output element is the same chain whatever M is and wherever its row falls: a zeroed
// accumulator, then one tile product per kb in order (the tile unit computes each element of a
// product from its own row and column alone), or one pair product per pair in order (the vector
// variant), then the bias in float32 and one rounding to bfloat16. So a row's result does not
// depend on the other rows of the call: the linears are batch-invariant by construction
// (docs/engine.md, "Batch invariance"), where oneDNN's GEMM blocks K differently by the row
// count. The two variants round differently from each other (a tile product sums 32 products
// before the accumulator; a pair product two), so a machine gives one or the other's bits by its
// plan's cpu_amx. Measured on a 2-core Xeon with AMX against oneDNN's packed GEMM over SmolLM2's
// seven linears of a layer: 2.7x faster at 1 row, 2.8x at 16, 2.0x at 64, 1.4x at 256 and 555,
// 1.17x at 2,048. The vector variant: docs/engine.md. Over GGUF blocks (quantized tiles) the
// vector variant computes the blocks' chain instead (below, before q_gemm): its own bits, not
// the dense copy's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "kernels.h"

namespace {

using namespace atom;

#ifdef ATOM_AVX512_BF16
constexpr int64_t TILE_BYTES = 1024;  // a packed B tile: 16 rows of 64 bytes

// Quantized weights (pack_tile_qweight in ops.py), dequantized into the B tiles a unit needs: one
// GGUF block of 32 weights is one column of a tile, so a tile is 16 blocks, stored in the tile's own
// order: row r (k = kb*32 + 2r, 2r+1) as 16 bytes of nibbles for Q4_0/Q4_1 (byte c: column c's two
// weights, low nibble first) or 32 int8 for Q8_0, then the 16 columns' d and (Q4_1) m as float16.
// A weight is the reference's (quant.py, dequantize_rows): d q + m (two roundings), d (q - 8),
// d q, rounded to bfloat16 as the dense copy is, so a linear gives the dense copy's bits. The tile's
// sizes and where its scales begin: kernels.h (qtile_bytes, q_scales_at).

// one packed tile of type `type` into 16 rows of 32 bfloat16 (1 KB)
inline void dequantize_tile(int64_t type, const uint8_t* src, c10::BFloat16* dst) {
  const int64_t scales = q_scales_at(type);
  const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + scales)));
  // lanes in the row's order: columns 0-7 twice each, then 8-15
  const __m512i lo_cols = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  const __m512 d0 = _mm512_permutexvar_ps(lo_cols, d16), d1 = _mm512_permutexvar_ps(hi_cols, d16);
  __m512 m0 = _mm512_setzero_ps(), m1 = m0;
  if (type == Q4_1) {
    const __m512 m16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + scales + 32)));
    m0 = _mm512_permutexvar_ps(lo_cols, m16), m1 = _mm512_permutexvar_ps(hi_cols, m16);
  }
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int r = 0; r < 16; ++r) {
    __m512 q0, q1;
    if (type == Q8_0) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * 32));
      q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
      q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * 16));
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
      q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
    }
    __m512 w0, w1;
    if (type == Q4_1) {
      w0 = _mm512_add_ps(_mm512_mul_ps(d0, q0), m0), w1 = _mm512_add_ps(_mm512_mul_ps(d1, q1), m1);
    } else if (type == Q4_0) {
      w0 = _mm512_mul_ps(d0, _mm512_sub_ps(q0, eight)), w1 = _mm512_mul_ps(d1, _mm512_sub_ps(q1, eight));
    } else {
      w0 = _mm512_mul_ps(d0, q0), w1 = _mm512_mul_ps(d1, q1);
    }
    _mm512_storeu_si512(dst + r * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w1, w0)));
  }
}

// one output row's 16 columns of a block (`live` of them): the float32 accumulator plus the bias, one rounding
// to bfloat16; both variants end every element here
inline void store_row(c10::BFloat16* out, __m512 acc, __m512 bias, __mmask16 live) {
  _mm256_mask_storeu_epi16(out, live, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(acc, bias))));
}

// the bias of `live` columns from `bias` (nullptr: none)
inline __m512 bias_lanes(const float* bias, __mmask16 live) {
  return bias ? _mm512_maskz_loadu_ps(live, bias) : _mm512_setzero_ps();
}

// rows 0 .. MR - 1's accumulators acc(i, j) for column blocks n0 / 16 .. + NR - 1 (of N columns), each
// plus the bias and rounded once into O (row stride N): the vector tiles' end
template <int MR, int NR, typename Acc>
inline void store_rows(c10::BFloat16* O, int64_t N, int64_t n0, const float* bias, Acc acc) {
  for (int j = 0; j < NR; ++j) {
    const int64_t n = n0 + j * 16, cols = std::min<int64_t>(16, N - n);
    const __mmask16 live = __mmask16((1u << cols) - 1);
    const __m512 b = bias_lanes(bias ? bias + n : nullptr, live);
    for (int i = 0; i < MR; ++i) store_row(O + i * N + n, acc(i, j), b, live);
  }
}

// the dim pair at x (two bfloat16) in every lane, as vdpbf16ps takes it
inline __m512bh x_pair(const c10::BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

// the bfloat16 tiles as packed: nothing to do but point at them
struct PackedTiles {
  static constexpr int64_t unit_rows = 64;
  const char* w;
  int64_t KB, step_stride;
  const char* panel(int64_t nb0, int64_t) const { return w + nb0 * KB * TILE_BYTES; }
  const char* step(int64_t nb0, int64_t, int64_t kb, int) const { return w + (nb0 * KB + kb) * TILE_BYTES; }
};

// quantized tiles, dequantized into this thread's buffers
struct QuantTiles {
  static constexpr int64_t unit_rows = 256;  // a unit dequantizes its panel: more rows to share it
  const uint8_t* w;
  int64_t KB, type, bytes, step_stride = TILE_BYTES;
  const uint8_t* tile(int64_t nb, int64_t kb) const { return w + (nb * KB + kb) * bytes; }
  const char* panel(int64_t nb0, int64_t nbs) const {
    thread_local std::vector<c10::BFloat16> buf;
    buf.resize(nbs * KB * 512);
    for (int64_t j = 0; j < nbs; ++j)
      for (int64_t kb = 0; kb < KB; ++kb) dequantize_tile(type, tile(nb0 + j, kb), &buf[(j * KB + kb) * 512]);
    return reinterpret_cast<const char*>(buf.data());
  }
  const char* step(int64_t nb0, int64_t nbs, int64_t kb, int slot) const {
    thread_local std::vector<c10::BFloat16> slots(2 * 4 * 512);
    c10::BFloat16* dst = &slots[slot * 4 * 512];
    for (int64_t j = 0; j < nbs; ++j) dequantize_tile(type, tile(nb0 + j, kb), dst + j * 512);
    return reinterpret_cast<const char*>(dst);
  }
};

// The same products on AVX512-BF16's pair dot products (vdpbf16ps), where the CPU has no AMX (a
// Zen 4 or 5) or cpu_amx is off. Row r of tile (nb, kb) is one register: pair k = kb*32 + 2r, 2r+1
// of the block's 16 columns; x's pair broadcast against it adds both products to each column's
// accumulator. Every output element is one chain whatever M is: a zeroed accumulator, then the K/2
// pairs in order, one vdpbf16ps each, then the bias in float32 and one rounding to bfloat16. A
// tile of up to VEC_MR rows by VEC_NR column blocks keeps its accumulators in registers; which tile
// an element falls in changes nothing of its chain, so any blocking gives the same bits.
constexpr int VEC_MR = 6, VEC_NR = 4;
// past VEC_MR rows, K in blocks of VEC_PAIRS pairs, every tile of a chunk of VEC_CHUNK rows taking a
// block while the panel's rows of it (VEC_NR x 4 KB) stay in L1; between blocks a tile's
// accumulators wait in float32 (stored and loaded back exactly: the chain is unchanged)
constexpr int64_t VEC_PAIRS = 64, VEC_CHUNK = 48;

// rows 0 .. MR - 1 of X by column blocks n0 / 16 .. + NR - 1, pairs p0 .. p1 - 1 of the panel's tiles
// ([NR][KB][1 KB]); from zero at p0 == 0, else from `park`; into `park` unless p1 ends K, then the
// bias and one rounding into O
template <int MR, int NR>
void vec_tile(c10::BFloat16* O, int64_t N, const c10::BFloat16* X, int64_t K, const char* panel, int64_t KB,
              int64_t n0, const float* bias, int64_t p0, int64_t p1, float* park) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = p0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(park + (i * NR + j) * 16);
  const int64_t stride = KB * TILE_BYTES;
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh w[NR];
    for (int j = 0; j < NR; ++j)
      w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + j * stride + p * 64));
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = x_pair(X + i * K + 2 * p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, w[j]);
    }
  }
  if (p1 < K / 2) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) _mm512_store_ps(park + (i * NR + j) * 16, acc[i][j]);
    return;
  }
  store_rows<MR, NR>(O, N, n0, bias, [&](int i, int j) { return acc[i][j]; });
}

using VecTile = void (*)(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const char*, int64_t, int64_t,
                         const float*, int64_t, int64_t, float*);
template <int MR>
constexpr VecTile vec_tiles_of(int nr) {
  return nr == 1 ? vec_tile<MR, 1> : nr == 2 ? vec_tile<MR, 2> : nr == 3 ? vec_tile<MR, 3> : vec_tile<MR, 4>;
}
inline VecTile vec_tile_for(int mr, int nr) {
  switch (mr) {
    case 1: return vec_tiles_of<1>(nr);
    case 2: return vec_tiles_of<2>(nr);
    case 3: return vec_tiles_of<3>(nr);
    case 4: return vec_tiles_of<4>(nr);
    case 5: return vec_tiles_of<5>(nr);
    default: return vec_tiles_of<6>(nr);
  }
}

// each thread a contiguous share of the column blocks; per VEC_NR blocks, its panel against every
// row of x in tiles of VEC_MR rows (past one tile, K blocked as above)
template <typename Source>
void vec_gemm(at::Tensor& out, const at::Tensor& x, int64_t NB, int64_t KB, const float* bias, Source& source) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), pairs = K / 2;
  const auto* X = x.data_ptr<c10::BFloat16>();
  auto* O = out.data_ptr<c10::BFloat16>();
  const int64_t block = M <= VEC_MR ? pairs : VEC_PAIRS;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float park[VEC_CHUNK / VEC_MR][VEC_MR * VEC_NR * 16];
    for (int64_t nb = b0; nb < b1; nb += VEC_NR) {
      const int64_t nbs = std::min<int64_t>(VEC_NR, b1 - nb);
      const char* panel = source.panel(nb, nbs);
      for (int64_t m0 = 0; m0 < M; m0 += VEC_CHUNK) {
        const int64_t m1 = std::min(M, m0 + VEC_CHUNK);
        for (int64_t p0 = 0; p0 < pairs; p0 += block) {
          const int64_t p1 = std::min(pairs, p0 + block);
          for (int64_t m = m0; m < m1; m += VEC_MR) {
            const int64_t rows = std::min<int64_t>(VEC_MR, m1 - m);
            vec_tile_for(int(rows), int(nbs))(O + m * N, N, X + m * K, K, panel, KB, nb * 16, bias, p0, p1,
                                              park[(m - m0) / VEC_MR]);
          }
        }
      }
    }
  });
}

// The vector variant over quantized tiles computes the blocks' chain, not the dense copy's: every output
// element is a zeroed float32 y, then per block b of K (one tile) in order: s = a zeroed accumulator and
// the block's 16 pairs in order, x's pair (bfloat16) against the weights' integers q (exact in bfloat16:
// Q4_1's 0..15, Q4_0's -8..7, Q8_0's -128..127), one vdpbf16ps each; y = fma(d, s, y); for Q4_1 also
// y = fma(m, sum_b(x), y) (sum_b(x): the block's 32 x in float32, summed in one fixed order per row);
// then the bias in float32 and one rounding to bfloat16. The scales apply to the exact products' sums
// instead of rounding each weight to bfloat16 first: within a rounding of the dense copy's product, and
// cheaper, since a tile row's integers come from its 16 bytes through a shuffle, a shift and one
// 32-entry table lookup (vpermw), where the dense copy's weights take two conversions and two float
// operations per 16 weights. Each element's chain is the same for any M and any blocking:
// batch-invariant. Measured on a Zen 4 (2 threads, SmolLM2's Q4_1 layers): 3.5 ms a decode at one row,
// against 4.0 for the int16 GEMV over the same blocks and 6.9-7.5 for the dense tiles.

// a row's integers as the table's index: byte c of the 16 (column c's two weights, the first in the low
// nibble) into words 2c and 2c + 1, the second shifted down by 4; vpermw reads the low 5 bits, and the
// table repeats its 16 entries, so the bits above the nibble do not matter
struct QIndex {
  __m512i ctrl = _mm512_set_epi32(0x0F0F0F0F, 0x0E0E0E0E, 0x0D0D0D0D, 0x0C0C0C0C, 0x0B0B0B0B, 0x0A0A0A0A,
                                  0x09090909, 0x08080808, 0x07070707, 0x06060606, 0x05050505, 0x04040404,
                                  0x03030303, 0x02020202, 0x01010101, 0x00000000);
  __m512i shifts = _mm512_set1_epi32(0x00040000);
  __m512i table;
};

template <int64_t Type>
inline QIndex q_index() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = Type == Q4_0 ? float((i & 15) - 8) : float(i & 15);
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    t[i] = uint16_t(u >> 16);  // a small integer: bfloat16 holds it exactly
  }
  QIndex q;
  q.table = _mm512_load_si512(t);
  return q;
}

// row r of a quantized tile as the integers q of its 16 columns' dim pairs, in bfloat16
template <int64_t Type>
inline __m512bh q_row(const uint8_t* tile, int r, const QIndex& c) {
  if constexpr (Type == Q8_0 || Type == Q6_K) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + r * 32));
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(q1, q0);  // exact: |q| <= 128 (Q6_K's q - 32: |q| <= 32)
  } else {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + r * 16)));
    const __m512i idx = _mm512_srlv_epi16(_mm512_shuffle_epi8(bytes, c.ctrl), c.shifts);
    return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(idx, c.table));
  }
}

// the types whose blocks add m times the block's sum of x
template <int64_t Type>
constexpr bool HAS_MIN = Type == Q4_1 || Type == Q4_K;

// the block's d (and Q4_1's m) of the tile's 16 columns; K-quants': s and Q4_K's m, or Q6_K's s of
// dims 0-15 (tile_d) and of dims 16-31 (tile_m)
template <int64_t Type>
inline __m512 tile_d(const uint8_t* tile) {
  if constexpr (is_k_quant(Type))  // K-quants: sub-blocks of 32 with float32 scales (kernels.h)
    return _mm512_loadu_ps(reinterpret_cast<const float*>(tile + q_scales_at(Type)));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + q_scales_at(Type))));
}
template <int64_t Type>
inline __m512 tile_m(const uint8_t* tile) {
  if constexpr (is_k_quant(Type)) return _mm512_loadu_ps(reinterpret_cast<const float*>(tile + q_scales_at(Type) + 64));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + q_scales_at(Type) + 32)));
}

// x's block sums, [M][K/32]: each row's own, in one order (the 32 values widened, the halves added, then
// a fixed tree), whatever M is
inline std::vector<float> block_sums(const c10::BFloat16* X, int64_t M, int64_t K) {
  const int64_t KB = K / 32;
  std::vector<float> sums(M * KB);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * KB; i < m1 * KB; ++i) {
      const __m512i v = _mm512_loadu_si512(X + i * 32);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
      sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  });
  return sums;
}

// up to QROWS rows: rows 0 .. MR - 1 of x against column blocks nb0 .. nb0 + NR - 1, every tile row's
// integers taken from its bytes as the products go
template <int MR, int NR, int64_t Type>
void q_tile_few(c10::BFloat16* O, int64_t N, const c10::BFloat16* X, int64_t K, const float* xsum,
                const QuantTiles& src, int64_t nb0, const float* bias) {
  const QIndex c = q_index<Type>();
  const int64_t KB = src.KB;
  __m512 y[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* t[NR];
    for (int j = 0; j < NR; ++j) t[j] = src.tile(nb0 + j, kb);
    __m512 s[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) s[i][j] = _mm512_setzero_ps();
    for (int r = 0; r < 16; ++r) {
      __m512bh a[MR];
      for (int i = 0; i < MR; ++i) a[i] = x_pair(X + i * K + kb * 32 + 2 * r);
      for (int j = 0; j < NR; ++j) {
        const __m512bh w = q_row<Type>(t[j], r, c);
        for (int i = 0; i < MR; ++i) s[i][j] = _mm512_dpbf16_ps(s[i][j], a[i], w);
      }
      if constexpr (Type == Q6_K) {
        if (r == 7)  // dims 0-15 end: their scale, and a fresh sum for dims 16-31
          for (int j = 0; j < NR; ++j) {
            const __m512 d = tile_d<Type>(t[j]);
            for (int i = 0; i < MR; ++i) y[i][j] = _mm512_fmadd_ps(d, s[i][j], y[i][j]), s[i][j] = _mm512_setzero_ps();
          }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 d = Type == Q6_K ? tile_m<Type>(t[j]) : tile_d<Type>(t[j]);
      for (int i = 0; i < MR; ++i) y[i][j] = _mm512_fmadd_ps(d, s[i][j], y[i][j]);
      if constexpr (HAS_MIN<Type>) {
        const __m512 m = tile_m<Type>(t[j]);
        for (int i = 0; i < MR; ++i) y[i][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[i * KB + kb]), y[i][j]);
      }
    }
  }
  store_rows<MR, NR>(O, N, nb0 * 16, bias, [&](int i, int j) { return y[i][j]; });
}

template <int MR, int64_t Type>
void q_rows_few(c10::BFloat16* O, int64_t N, const c10::BFloat16* X, int64_t K, const float* xsum,
                const QuantTiles& src, int64_t b0, int64_t b1, const float* bias) {
  constexpr int NR = MR <= 2 ? 4 : 2;
  int64_t nb = b0;
  for (; nb + NR <= b1; nb += NR) q_tile_few<MR, NR, Type>(O, N, X, K, xsum, src, nb, bias);
  for (; nb < b1; ++nb) q_tile_few<MR, 1, Type>(O, N, X, K, xsum, src, nb, bias);
}

// past QROWS rows: a thread's QNR column blocks at a time, their tiles' integers unpacked once into a
// panel ([QNR][KB][16 rows][32] bfloat16, with each tile's d and m as float32), then every row of x
// against it, QMR rows at a time. Up to QROWS rows, four at a time through the few-row tiles: at 5-8
// rows unpacking the panel costs more than reading the bytes twice (SmolLM2's layers, Zen 4)
constexpr int64_t QROWS = 8;
constexpr int QMR = 6, QNR = 4;

template <int64_t Type>
struct QPanel {
  std::vector<c10::BFloat16> q;
  std::vector<float> d, m;
  void unpack(const QuantTiles& src, int64_t nb0, int64_t nbs) {
    const QIndex c = q_index<Type>();
    const int64_t KB = src.KB;
    q.resize(nbs * KB * 512), d.resize(nbs * KB * 16), m.resize(nbs * KB * 16);
    for (int64_t j = 0; j < nbs; ++j)
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint8_t* t = src.tile(nb0 + j, kb);
        for (int r = 0; r < 16; ++r)
          _mm512_storeu_si512(&q[(j * KB + kb) * 512 + r * 32], reinterpret_cast<__m512i>(q_row<Type>(t, r, c)));
        _mm512_storeu_ps(&d[(j * KB + kb) * 16], tile_d<Type>(t));
        if constexpr (HAS_MIN<Type> || Type == Q6_K) _mm512_storeu_ps(&m[(j * KB + kb) * 16], tile_m<Type>(t));
      }
  }
};

// rows 0 .. MR - 1 of x by column blocks n0 / 16 .. + NR - 1: each block's s in registers, y in `park`
// (float32 there and back: the chain is unchanged), then the bias and one rounding into O
template <int MR, int NR, int64_t Type>
void q_tile_many(c10::BFloat16* O, int64_t N, const c10::BFloat16* X, int64_t K, const float* xsum,
                 const QPanel<Type>& panel, int64_t KB, int64_t n0, const float* bias, float* park) {
  for (int e = 0; e < MR * NR; ++e) _mm512_store_ps(park + e * 16, _mm512_setzero_ps());
  for (int64_t kb = 0; kb < KB; ++kb) {
    __m512 s[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) s[i][j] = _mm512_setzero_ps();
    const c10::BFloat16* q = &panel.q[kb * 512];
    // dims r0 .. r1 - 1's pairs into s, then each column's scale d into y (parked)
    auto pairs = [&](int r0, int r1, const std::vector<float>& scales) {
      for (int r = r0; r < r1; ++r) {
        __m512bh w[NR];
        for (int j = 0; j < NR; ++j) w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + j * KB * 512 + r * 32));
        for (int i = 0; i < MR; ++i) {
          const __m512bh a = x_pair(X + i * K + kb * 32 + 2 * r);
          for (int j = 0; j < NR; ++j) s[i][j] = _mm512_dpbf16_ps(s[i][j], a, w[j]);
        }
      }
      for (int j = 0; j < NR; ++j) {
        const __m512 d = _mm512_loadu_ps(&scales[(j * KB + kb) * 16]);
        const __m512 m = HAS_MIN<Type> ? _mm512_loadu_ps(&panel.m[(j * KB + kb) * 16]) : _mm512_setzero_ps();
        for (int i = 0; i < MR; ++i) {
          float* y = park + (i * NR + j) * 16;
          __m512 v = _mm512_fmadd_ps(d, s[i][j], _mm512_load_ps(y));
          if constexpr (HAS_MIN<Type>) v = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[i * KB + kb]), v);
          _mm512_store_ps(y, v);
          s[i][j] = _mm512_setzero_ps();
        }
      }
    };
    if constexpr (Type == Q6_K) {  // each half of the block its own scale: dims 0-15, then 16-31
      pairs(0, 8, panel.d);
      pairs(8, 16, panel.m);
    } else {
      pairs(0, 16, panel.d);
    }
  }
  store_rows<MR, NR>(O, N, n0, bias, [&](int i, int j) { return _mm512_load_ps(park + (i * NR + j) * 16); });
}

template <int64_t Type>
using QTileMany = void (*)(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const float*, const QPanel<Type>&,
                           int64_t, int64_t, const float*, float*);
template <int MR, int64_t Type>
constexpr QTileMany<Type> q_tiles_of(int nr) {
  return nr == 1 ? q_tile_many<MR, 1, Type> : nr == 2 ? q_tile_many<MR, 2, Type>
                                          : nr == 3 ? q_tile_many<MR, 3, Type> : q_tile_many<MR, 4, Type>;
}

template <int64_t Type>
QTileMany<Type> q_tile_for(int mr, int nr) {
  switch (mr) {
    case 1: return q_tiles_of<1, Type>(nr);
    case 2: return q_tiles_of<2, Type>(nr);
    case 3: return q_tiles_of<3, Type>(nr);
    case 4: return q_tiles_of<4, Type>(nr);
    case 5: return q_tiles_of<5, Type>(nr);
    default: return q_tiles_of<6, Type>(nr);
  }
}

template <int64_t Type>
void q_gemm(at::Tensor& out, const at::Tensor& x, int64_t NB, const float* bias, const QuantTiles& src) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), KB = K / 32;
  const auto* X = x.data_ptr<c10::BFloat16>();
  auto* O = out.data_ptr<c10::BFloat16>();
  const std::vector<float> xsum = HAS_MIN<Type> ? block_sums(X, M, K) : std::vector<float>();
  const float* sums = HAS_MIN<Type> ? xsum.data() : nullptr;
  if (M <= QROWS) {  // groups of up to four rows, each through the few-row tiles
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t m = 0; m < M; m += 4) {
        const float* sm = sums ? sums + m * KB : nullptr;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: q_rows_few<1, Type>(O + m * N, N, X + m * K, K, sm, src, b0, b1, bias); break;
          case 2: q_rows_few<2, Type>(O + m * N, N, X + m * K, K, sm, src, b0, b1, bias); break;
          case 3: q_rows_few<3, Type>(O + m * N, N, X + m * K, K, sm, src, b0, b1, bias); break;
          default: q_rows_few<4, Type>(O + m * N, N, X + m * K, K, sm, src, b0, b1, bias);
        }
      }
    });
    return;
  }
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    thread_local QPanel<Type> panel;
    alignas(64) float park[QMR * QNR * 16];
    for (int64_t nb = b0; nb < b1; nb += QNR) {
      const int64_t nbs = std::min<int64_t>(QNR, b1 - nb);
      panel.unpack(src, nb, nbs);
      for (int64_t m = 0; m < M; m += QMR) {
        const int64_t rows = std::min<int64_t>(QMR, M - m);
        q_tile_for<Type>(int(rows), int(nbs))(O + m * N, N, X + m * K, K, sums ? sums + m * KB : nullptr, panel, KB,
                                              nb * 16, bias, park);
      }
    }
  });
}
#endif

#ifdef ATOM_AMX_BF16
// A unit of many rows: up to the source's `unit_rows` rows by two column blocks, K in blocks of
// K_BLOCK tile steps (a row pair's A tiles and the B tiles of a block, 32 KB, stay in L1). The
// rows are cut in chunks of about equal size: at 256 rows a unit, 555 rows (chunks of 256, 256
// and 43) had left one thread twice the other's work. On the 2-core Xeon,
// bfloat16 tiles at 64 rows a unit against 256 and K whole: 1.2x a layer at 2,048 rows and
// 1.3x at 555 (same run, same bits). Quantized tiles keep 256 rows a unit, since a unit
// dequantizes its panel once.
constexpr int64_t K_BLOCK = 8;

// 16-row blocks of a unit past 16 rows: `max_rows` or fewer, the chunks of rows as even as they
// can be, so that any contiguous share of the units is a fair share of the work; an even number
// (2 x 2 blocks; `most` is even, so rounding up stays within it)
inline int64_t unit_blocks(int64_t MB, int64_t max_rows) {
  const int64_t most = max_rows / 16, chunks = (MB + most - 1) / most, blocks = (MB + chunks - 1) / chunks;
  return blocks + blocks % 2;
}

// tiles 0-3, a unit's accumulators
inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// the accumulator's valid rows and columns, plus the bias, rounded to bfloat16 into out (row stride ldo)
inline void store_tile(c10::BFloat16* out, int64_t ldo, const float* c, int64_t rows, int64_t cols, const float* bias) {
  const __mmask16 live = __mmask16((1u << cols) - 1);
  const __m512 b = bias_lanes(bias, live);
  for (int64_t r = 0; r < rows; ++r) store_row(out + r * ldo, _mm512_load_ps(c + r * 16), b, live);
}

// Where a unit's B tiles come from: `source.panel(nb0, nbs)`, the tiles of column blocks nb0 .. nb0
// + nbs - 1 for every kb, [nbs][KB][1 KB] (a unit of many rows reads each KB times);
// `source.step(nb0, nbs, kb, slot)`, those of one kb (a unit of up to 16 rows reads each once:
// a quantized weight is dequantized a step ahead of the products that read it, into one of two
// slots that stay in L1), tile j at + j * `source.step_stride`.
template <typename Source>
void amx_gemm(at::Tensor& out, const at::Tensor& x, int64_t NB, int64_t KB, const float* bias, Source& source) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t MB = (M + 15) / 16, lda = K * int64_t(sizeof(c10::BFloat16));
  const auto* X = x.data_ptr<c10::BFloat16>();
  auto* O = out.data_ptr<c10::BFloat16>();
  // a unit: NG column blocks for one chunk of rows. Up to 16 rows, four column blocks share each
  // A tile (one A, two B tiles in turn, four accumulators); past that, 2 x 2 blocks
  const int64_t NG = M <= 16 ? 4 : 2, groups = (NB + NG - 1) / NG;
  const int64_t chunk_blocks = unit_blocks(MB, Source::unit_rows), chunks = (MB + chunk_blocks - 1) / chunk_blocks;
  at::parallel_for(0, chunks * groups, 1, [&](int64_t u0, int64_t u1) {
    TileScope scope;
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) float acc[4][256];
    alignas(64) float parked[Source::unit_rows / 32][4 * 256];  // each row pair's accumulators between K blocks
    std::vector<c10::BFloat16> tail;  // the last block's rows beside zeros: every A tile reads 16 rows
    if (M % 16) {
      tail.assign(16 * K, c10::BFloat16(0.f));
      std::memcpy(tail.data(), X + (MB - 1) * 16 * K, (M % 16) * K * sizeof(c10::BFloat16));
    }
    auto a_block = [&](int64_t mb) { return mb == MB - 1 && M % 16 ? tail.data() : X + mb * 16 * K; };
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t chunk = u / groups, nb0 = u % groups * NG, nbs = std::min(NG, NB - nb0);
      if (M <= 16) {
        const c10::BFloat16* a = a_block(0);
        const int64_t stride = source.step_stride;
        zero_accumulators();
        const char* next = source.step(nb0, nbs, 0, 0);
        for (int64_t kb = 0; kb < KB; ++kb) {
          const char* b = next;
          _tile_loadd(4, a + kb * 32, lda);
          _tile_loadd(5, b, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (nbs > 1) {
            _tile_loadd(6, b + stride, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (kb + 1 < KB) next = source.step(nb0, nbs, kb + 1, (kb + 1) % 2);  // while the products run
          if (nbs > 2) {
            _tile_loadd(5, b + 2 * stride, 64);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (nbs > 3) {
            _tile_loadd(6, b + 3 * stride, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        _tile_stored(0, acc[0], 64);
        if (nbs > 1) _tile_stored(1, acc[1], 64);
        if (nbs > 2) _tile_stored(2, acc[2], 64);
        if (nbs > 3) _tile_stored(3, acc[3], 64);
        for (int64_t j = 0; j < nbs; ++j) {
          const int64_t n0 = (nb0 + j) * 16;
          store_tile(O + n0, N, acc[j], M, std::min<int64_t>(16, N - n0), bias ? bias + n0 : nullptr);
        }
        continue;
      }
      const char* panel = source.panel(nb0, nbs);
      auto b_tile = [&](int64_t j, int64_t kb) { return panel + (j * KB + kb) * TILE_BYTES; };
      const int64_t mb_begin = chunk * chunk_blocks, mb_end = std::min(MB, mb_begin + chunk_blocks);
      const bool two_n = nbs > 1;
      // K in blocks of K_BLOCK tile steps, every row pair of the chunk taking a block while its B
      // tiles are in L1; between blocks a pair's accumulators wait in `parked` (float32 there and
      // back: the chain is unchanged)
      for (int64_t k0 = 0; k0 < KB; k0 += K_BLOCK) {
        const int64_t k1 = std::min(KB, k0 + K_BLOCK);
        for (int64_t mb = mb_begin; mb < mb_end; mb += 2) {
          const bool two_m = mb + 1 < mb_end;
          const c10::BFloat16 *a0 = a_block(mb), *a1 = two_m ? a_block(mb + 1) : a0;
          float* park = parked[(mb - mb_begin) / 2];
          if (k0 == 0) {
            zero_accumulators();
          } else {
            _tile_loadd(0, park, 64);  // tile numbers are immediates: no loop
            _tile_loadd(1, park + 256, 64);
            _tile_loadd(2, park + 512, 64);
            _tile_loadd(3, park + 768, 64);
          }
          for (int64_t kb = k0; kb < k1; ++kb) {
            _tile_loadd(4, a0 + kb * 32, lda);
            _tile_loadd(6, b_tile(0, kb), 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_n) {
              _tile_loadd(7, b_tile(1, kb), 64);
              _tile_dpbf16ps(1, 4, 7);
            }
            if (two_m) {
              _tile_loadd(5, a1 + kb * 32, lda);
              _tile_dpbf16ps(2, 5, 6);
              if (two_n) _tile_dpbf16ps(3, 5, 7);
            }
          }
          if (k1 < KB) {
            _tile_stored(0, park, 64);
            _tile_stored(1, park + 256, 64);
            _tile_stored(2, park + 512, 64);
            _tile_stored(3, park + 768, 64);
            continue;
          }
          _tile_stored(0, acc[0], 64);
          if (two_n) _tile_stored(1, acc[1], 64);
          if (two_m) _tile_stored(2, acc[2], 64);
          if (two_m && two_n) _tile_stored(3, acc[3], 64);
          for (int64_t i = 0; i < (two_m ? 2 : 1); ++i)
            for (int64_t j = 0; j < (two_n ? 2 : 1); ++j) {
              const int64_t m0 = (mb + i) * 16, n0 = (nb0 + j) * 16;
              store_tile(O + m0 * N + n0, N, acc[i * 2 + j], std::min<int64_t>(16, M - m0),
                         std::min<int64_t>(16, N - n0), bias ? bias + n0 : nullptr);
            }
        }
      }
    }
  });
}
#endif

#ifdef ATOM_AVX512_BF16
// the checks every tile linear makes; the bias as float32 (undefined without one)
at::Tensor check_linear(const char* name, const at::Tensor& out, const at::Tensor& x, int64_t NB, int64_t KB,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name, ": x must be [M, K] bf16");
  TORCH_CHECK(KB * 32 == x.size(1), name, ": the weight must be packed for K = ", x.size(1));
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kBFloat16 &&
                  out.size(0) == x.size(0) && (out.size(1) + 15) / 16 == NB,
              name, ": out must be [M, N] bf16");
  if (!bias || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == out.size(1), name, ": bias must have N elements");
  return bias->to(at::kFloat).contiguous();
}

// on the AMX tiles where asked for (the plan's cpu_amx), built and lent, else the vector variant
template <typename Source>
void tile_gemm(at::Tensor& out, const at::Tensor& x, int64_t NB, int64_t KB, const float* bias, Source& source,
               bool amx) {
#ifdef ATOM_AMX_BF16
  if (amx && amx_permitted()) {
    if constexpr (std::is_same_v<Source, QuantTiles>)
      TORCH_CHECK(!is_k_quant(source.type), "tile_qlinear: K-quants' tiles run on the vector variant only (amx off)");
    return amx_gemm(out, x, NB, KB, bias, source);
  }
#endif
  if constexpr (std::is_same_v<Source, QuantTiles>) {  // the blocks' chain (above)
    if (source.type == Q4_1) return q_gemm<Q4_1>(out, x, NB, bias, source);
    if (source.type == Q4_K) return q_gemm<Q4_K>(out, x, NB, bias, source);
    if (source.type == Q6_K) return q_gemm<Q6_K>(out, x, NB, bias, source);
    if (source.type == Q4_0) return q_gemm<Q4_0>(out, x, NB, bias, source);
    return q_gemm<Q8_0>(out, x, NB, bias, source);
  } else {
    vec_gemm(out, x, NB, KB, bias, source);
  }
}
#endif

}  // namespace

namespace atom::op {

// out [M, N] bfloat16 = x [M, K] W^T (+ bias), W packed as B tiles [ceil(N/16)][K/32][16][32]; on the AMX
// tiles where `amx` and the build has them and the OS lends them, else on AVX512-BF16's pair products
void tile_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                 bool amx) {
#ifdef ATOM_AVX512_BF16
  TORCH_CHECK(wp.dim() == 4 && wp.is_contiguous() && wp.scalar_type() == at::kBFloat16 && wp.size(2) == 16 &&
                  wp.size(3) == 32,
              "tile_linear: the weight must be packed as B tiles");
  const at::Tensor b = check_linear("tile_linear", out, x, wp.size(0), wp.size(1), bias);
  if (x.size(0) == 0) return;
  PackedTiles source{reinterpret_cast<const char*>(wp.data_ptr()), wp.size(1), wp.size(1) * TILE_BYTES};
  tile_gemm(out, x, wp.size(0), wp.size(1), b.defined() ? b.data_ptr<float>() : nullptr, source, amx);
#else
  TORCH_CHECK(false, "tile_linear: this build has no bfloat16 tile kernels (the CPU lacks AVX512-BF16)");
#endif
}

// the same with W as GGUF blocks of type `qtype` (Q4_0, Q4_1, Q8_0; on the vector variant Q4_K and Q6_K too, as
// sub-blocks with float32 scales) packed as tiles [ceil(N/16)][K/32][bytes]
void tile_qlinear(at::Tensor& out, const at::Tensor& x, const at::Tensor& wq, int64_t qtype,
                  const c10::optional<at::Tensor>& bias, bool amx) {
#ifdef ATOM_AVX512_BF16
  TORCH_CHECK(has_qtiles(qtype), "tile_qlinear: type ", qtype, " has no tiles");
  TORCH_CHECK(wq.dim() == 3 && wq.is_contiguous() && wq.scalar_type() == at::kByte && wq.size(2) == qtile_bytes(qtype),
              "tile_qlinear: the weight must be packed as tiles of type ", qtype);
  const at::Tensor b = check_linear("tile_qlinear", out, x, wq.size(0), wq.size(1), bias);
  if (x.size(0) == 0) return;
  QuantTiles source{wq.data_ptr<uint8_t>(), wq.size(1), qtype, qtile_bytes(qtype)};
  tile_gemm(out, x, wq.size(0), wq.size(1), b.defined() ? b.data_ptr<float>() : nullptr, source, amx);
#else
  TORCH_CHECK(false, "tile_qlinear: this build has no bfloat16 tile kernels (the CPU lacks AVX512-BF16)");
#endif
}

}  // namespace atom::op

namespace atom {
void tile_linear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, bool amx) {
  op::tile_linear(out, x, packed, bias, amx);
}
void tile_qlinear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                       const c10::optional<at::Tensor>& bias, bool amx) {
  op::tile_qlinear(out, x, packed, qtype, bias, amx);
}
}  // namespace atom
