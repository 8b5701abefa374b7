// GGUF block-quantized weights used as they are stored (models/quant.py holds
// them and has the portable reference of each op):
//
// qgemv:       out = x W^T (+ b) for any number of rows of float32 x, each
//              element by the same arithmetic whatever the rows (batch-invariant);
//              W's blocks are used as stored, so for a decode's 1-4 rows the
//              packed bytes stream once
// dequantize:  out = W as floats (rows of blocks; float32, bfloat16, float16)
//
// A row of W is K / 32 blocks of 32 weights, in ggml's layouts:
//   Q8_0 (34 bytes):  d f16, q int8[32]                 w = d q
//   Q4_0 (18 bytes):  d f16, nibbles[16]                w = d (q - 8)
//   Q4_1 (20 bytes):  d f16, m f16, nibbles[16]         w = d q + m
// where byte j holds weight j in its low nibble and weight j + 16 in its high; and super-blocks of 256:
//   Q4_K (144 bytes): d f16, dmin f16, 6-bit scale and min of 8 sub-blocks of 32 (12 bytes), nibbles[128]
//                     w = d sc q - dmin mn; bytes 32p..32p+31 hold sub-block 2p (low nibbles) and 2p + 1 (high)
//   Q6_K (210 bytes): low nibbles[128], high 2 bits[64], int8 scales of 16 groups of 16, d f16   w = d sc (q - 32)
// (ggml-quants.c's dequantize_row_q4_K / q6_K). The kernels see any block as sub-blocks of 32: w = s q + m.
// The GEMV rounds x to int16 per block of 32 (a = x / dx, dx = max|x| / 32767),
// multiplies the integer weights by a in int32 (exact) and sums a block as
// d dx (q . a) + m sum(x), with the float block sums of x; x's blocks are
// prepared once per call. Q4_0 is Q4_1 with m = -8 d.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <new>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using namespace atom;

constexpr int QK = 32;    // weights per block (per sub-block of a K-quant)
constexpr int QKK = 256;  // weights per K-quant super-block

inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: TORCH_CHECK(false, "quantized type ", type, " is not supported (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)");
  }
}

inline int64_t weights_per_block(int64_t type) { return is_k_quant(type) ? QKK : QK; }

// block_bytes of a 32-weight block type (Q4_0, Q4_1, Q8_0), for the templates
template <int64_t Type>
constexpr int64_t BLOCK32_BYTES = Type == Q8_0 ? 34 : Type == Q4_1 ? 20 : 18;

// a 32-weight block's offset m in w = d q + m: Q4_1's stored minimum, Q4_0's -8 d, Q8_0's none
template <int64_t Type>
inline float block_offset(const uint8_t* b) {
  return Type == Q4_1 ? half_at(b + 2) : Type == Q4_0 ? -8.f * half_at(b) : 0.f;
}

// one block as 32 float weights q[0..31] (before the scale) and its scale d and offset m: w = d q + m
template <int64_t Type>
struct Block {
  V8 q[4];
  float d, m;
};

#if defined(__AVX2__) && defined(__FMA__)
inline V8 u8_to_float(__m128i bytes) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))}; }
inline V8 i8_to_float(__m128i bytes) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))}; }

template <int64_t Type>
inline void decode(const uint8_t* b, Block<Type>& out) {
  out.d = half_at(b);
  if constexpr (Type == Q8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    out.q[0] = i8_to_float(lo), out.q[1] = i8_to_float(_mm_unpackhi_epi64(lo, lo));
    out.q[2] = i8_to_float(hi), out.q[3] = i8_to_float(_mm_unpackhi_epi64(hi, hi));
    out.m = 0.f;
  } else {
    const int offset = Type == Q4_1 ? 4 : 2;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + offset));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    out.q[0] = u8_to_float(lo), out.q[1] = u8_to_float(_mm_unpackhi_epi64(lo, lo));
    out.q[2] = u8_to_float(hi), out.q[3] = u8_to_float(_mm_unpackhi_epi64(hi, hi));
    out.m = block_offset<Type>(b);
  }
}
#else
template <int64_t Type>
inline void decode(const uint8_t* b, Block<Type>& out) {
  float q[QK];
  out.d = half_at(b);
  if constexpr (Type == Q8_0) {
    for (int j = 0; j < QK; ++j) q[j] = float(int8_t(b[2 + j]));
    out.m = 0.f;
  } else {
    const uint8_t* qs = b + (Type == Q4_1 ? 4 : 2);
    for (int j = 0; j < QK / 2; ++j) q[j] = float(qs[j] & 0x0F), q[j + 16] = float(qs[j] >> 4);
    out.m = block_offset<Type>(b);
  }
  for (int i = 0; i < 4; ++i) out.q[i] = load(q + 8 * i);
}
#endif

// a cache line's alignment for the tiles' operands: a 32-byte load never straddles two lines
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const LineAligned&) const { return true; }
};
template <typename T>
using Lines = std::vector<T, LineAligned<T>>;

// x's rows as int16 blocks: a = round(x / dx) with dx = max |x| / 32767 per block of 32 (a relative error of
// 2^-16 of the block's largest value, far below float16's), and the blocks' float sums
struct XBlocks {
  Lines<int16_t> a;
  std::vector<float> dx, xsum;

  // `padded_rows` >= rows: zero rows after x's (a tile's partner for an odd last row)
  XBlocks(const float* x, int64_t rows, int64_t K, int64_t padded_rows = 0)
      : a(std::max(rows, padded_rows) * K), dx(rows * K / QK), xsum(rows * K / QK) {
    // each block on its own, so a GEMM's rows are prepared in parallel with the same bits
    at::parallel_for(0, rows * K / QK, rows > 4 ? 64 : rows * K / QK, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* xb = x + b * QK;
        float amax = 0.f, sum = 0.f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::abs(xb[j])), sum += xb[j];
        const float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QK; ++j) a[b * QK + j] = int16_t(std::nearbyint(xb[j] * inv));
        dx[b] = d, xsum[b] = sum;
      }
    });
  }
};

#if defined(__AVX2__) && defined(__FMA__)
struct Weights16 {
  __m256i lo, hi;  // the block's 32 integer weights as int16, in weight order
};

template <int64_t Type>
inline Weights16 block_weights(const uint8_t* b) {
  if constexpr (Type == Q8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    return {_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)};
  } else {
    // widened to 16 bits first, each byte's two nibbles split with one mask and one shift
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Type == Q4_1 ? 4 : 2)));
    const __m256i bytes = _mm256_cvtepu8_epi16(packed);
    return {_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(bytes, 4)};
  }
}

// the 32 products of the block's weights and a, as eight float partial sums (exact in int32: |q a| < 2^7 2^15)
inline V8 block_dot(const Weights16& w, const int16_t* a) {
  const __m256i lo = _mm256_madd_epi16(w.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m256i hi = _mm256_madd_epi16(w.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16)));
  return {_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi))};
}

// the 16 products of half h (weights 16 h .. 16 h + 15) of the block's weights and a
inline V8 half_dot(const Weights16& w, const int16_t* a, int h) {
  const __m256i ah = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * h));
  return {_mm256_cvtepi32_ps(_mm256_madd_epi16(h ? w.hi : w.lo, ah))};
}

inline void weights_to_float(const Weights16& w, V8 out[4]) {
  out[0] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w.lo)))};
  out[1] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(w.lo, 1)))};
  out[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w.hi)))};
  out[3] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(w.hi, 1)))};
}

// sub-block j (weights 32 j .. 32 j + 31) of a K-quant super-block as integers: Q4_K's 0..15, Q6_K's -32..31
template <int64_t Type>
inline Weights16 sub_block_weights(const uint8_t* b, int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i q;
  if constexpr (Type == Q4_K) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (j / 2)));
    q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
  } else {
    const int h = j / 4, t = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(0x03));
    q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1))};
}
#else
struct Weights16 {
  int32_t q[QK];
};

template <int64_t Type>
inline Weights16 block_weights(const uint8_t* b) {
  Weights16 w;
  if constexpr (Type == Q8_0) {
    for (int j = 0; j < QK; ++j) w.q[j] = int8_t(b[2 + j]);
  } else {
    const uint8_t* qs = b + (Type == Q4_1 ? 4 : 2);
    for (int j = 0; j < QK / 2; ++j) w.q[j] = qs[j] & 0x0F, w.q[j + 16] = qs[j] >> 4;
  }
  return w;
}

inline V8 block_dot(const Weights16& w, const int16_t* a) {
  int32_t sum = 0;
  for (int j = 0; j < QK; ++j) sum += w.q[j] * a[j];
  V8 out = splat(0.f);
  out.v[0] = float(sum);
  return out;
}

inline V8 half_dot(const Weights16& w, const int16_t* a, int h) {
  int32_t sum = 0;
  for (int j = 16 * h; j < 16 * h + 16; ++j) sum += w.q[j] * a[j];
  V8 out = splat(0.f);
  out.v[0] = float(sum);
  return out;
}

inline void weights_to_float(const Weights16& w, V8 out[4]) {
  float q[QK];
  for (int j = 0; j < QK; ++j) q[j] = float(w.q[j]);
  for (int i = 0; i < 4; ++i) out[i] = load(q + 8 * i);
}

template <int64_t Type>
inline Weights16 sub_block_weights(const uint8_t* b, int j) {
  Weights16 w;
  for (int i = 0; i < QK; ++i) {
    if constexpr (Type == Q4_K) {
      const uint8_t byte = b[16 + 32 * (j / 2) + i];
      w.q[i] = j & 1 ? byte >> 4 : byte & 0x0F;
    } else {
      const int h = j / 4, t = j % 4;
      const int lo = (b[64 * h + 32 * (t & 1) + i] >> (4 * (t >> 1))) & 0x0F;
      const int hi = (b[128 + 32 * h + i] >> (2 * t)) & 0x03;
      w.q[i] = (lo | hi << 4) - 32;
    }
  }
  return w;
}
#endif

// sub-block j of a K-quant super-block: w = s q + m, with s2 in place of s for its second 16 weights
// (Q6_K's scales are per 16); the products and sums as ggml's reference rounds them
struct SubScales {
  float s, s2, m;
};

template <int64_t Type>
inline void super_block_scales(const uint8_t* b, SubScales s[8]) {
  if constexpr (Type == Q4_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* q = b + 4;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0x0F) | (q[j - 4] >> 6) << 4;
      const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | (q[j] >> 6) << 4;
      s[j] = {d * float(sc), d * float(sc), -(dmin * float(mn))};
    }
  } else {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 8; ++j) s[j] = {d * float(sc[2 * j]), d * float(sc[2 * j + 1]), 0.f};
  }
}

// rows [n0, n1) of W against the M rows of x: per block, d dx (q . a) + m sum(x); even and odd blocks sum
// apart, so that two chains of additions overlap
template <int M, int64_t Type>
void qgemv_rows(const XBlocks& x, int64_t m0, int64_t K, const uint8_t* w, float* out, int64_t ldo, const float* bias,
                int64_t n0, int64_t n1) {
  constexpr int64_t BB = BLOCK32_BYTES<Type>;
  const int64_t nb = K / QK;
  const int16_t* a = x.a.data();
  const float* dx = x.dx.data();
  const float* xsum = x.xsum.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * BB;
    V8 acc[2][M];
    float offset[2][M];
    for (int p = 0; p < 2; ++p)
      for (int m = 0; m < M; ++m) acc[p][m] = splat(0.f), offset[p][m] = 0.f;
    auto add_block = [&](int64_t b, int p) {
      const uint8_t* blk = row + b * BB;
      const Weights16 q = block_weights<Type>(blk);
      const float d = half_at(blk);
      const float mn = block_offset<Type>(blk);
      for (int m = 0; m < M; ++m) {
        const int64_t xb = (m0 + m) * nb + b;
        acc[p][m] = fma(splat(d * dx[xb]), block_dot(q, a + xb * QK), acc[p][m]);
        if constexpr (Type != Q8_0) offset[p][m] += mn * xsum[xb];
      }
    };
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) add_block(b, 0), add_block(b + 1, 1);
    if (b < nb) add_block(b, 0);
    for (int m = 0; m < M; ++m)
      out[(m0 + m) * ldo + n] = hsum(add(acc[0][m], acc[1][m])) + (offset[0][m] + offset[1][m]) + (bias ? bias[n] : 0.f);
  }
}

// the same for K-quants, a sub-block of 32 at a time: s dx (q . a) + m sum(x) (Q6_K: per half, no m)
template <int M, int64_t Type>
void kgemv_rows(const XBlocks& x, int64_t m0, int64_t K, const uint8_t* w, float* out, int64_t ldo, const float* bias,
                int64_t n0, int64_t n1) {
  constexpr int64_t BB = Type == Q4_K ? 144 : 210;
  const int64_t nb = K / QK;
  const int16_t* a = x.a.data();
  const float* dx = x.dx.data();
  const float* xsum = x.xsum.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * (K / QKK) * BB;
    V8 acc[M];
    float offset[M];
    for (int m = 0; m < M; ++m) acc[m] = splat(0.f), offset[m] = 0.f;
    for (int64_t sb = 0; sb < K / QKK; ++sb) {
      const uint8_t* blk = row + sb * BB;
      SubScales s[8];
      super_block_scales<Type>(blk, s);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // unrolled: each sub-block's shifts and offsets are constants
        const Weights16 q = sub_block_weights<Type>(blk, j);
        for (int m = 0; m < M; ++m) {
          const int64_t xb = (m0 + m) * nb + sb * 8 + j;
          if constexpr (Type == Q6_K) {
            acc[m] = fma(splat(s[j].s * dx[xb]), half_dot(q, a + xb * QK, 0), acc[m]);
            acc[m] = fma(splat(s[j].s2 * dx[xb]), half_dot(q, a + xb * QK, 1), acc[m]);
          } else {
            acc[m] = fma(splat(s[j].s * dx[xb]), block_dot(q, a + xb * QK), acc[m]);
            offset[m] += s[j].m * xsum[xb];
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) out[(m0 + m) * ldo + n] = hsum(acc[m]) + offset[m] + (bias ? bias[n] : 0.f);
  }
}

template <int M, int64_t Type>
inline void gemv_group(const XBlocks& x, int64_t m0, int64_t K, const uint8_t* w, float* out, int64_t ldo,
                       const float* bias, int64_t n0, int64_t n1) {
  if constexpr (is_k_quant(Type))
    kgemv_rows<M, Type>(x, m0, K, w, out, ldo, bias, n0, n1);
  else
    qgemv_rows<M, Type>(x, m0, K, w, out, ldo, bias, n0, n1);
}

#if defined(ATOM_ELEMENTWISE_AVX512) && defined(__AVX2__) && defined(__FMA__)
// Past four rows, Q4_0/Q4_1/Q8_0 blocks sixteen lanes at a time with qgemv_rows' arithmetic: one register
// holds a row's even-block accumulator (low half) and its odd-block one (high half), fed blocks b and
// b + 1 side by side. Each half gets the eight int32 lanes block_dot gives that block (the same pairs of
// products, exact in int32), scaled by the same d dx and added by the same fma; the offsets m sum(x) are
// the same products and sums (sixteen rows of x to a register); the end is the same horizontal sum of
// the two halves' sum. W's rows are decoded once per chunk (int16 weights, scales, offsets) and every
// row of x passes over them, three at a time, a tile's x in L1.

// x per row and pair of blocks (b, b + 1): the int16 halves [b 0..15 | b+1 0..15], [b 16..31 | b+1 16..31]
// and the scales [dx_b x8 | dx_b+1 x8] (a missing b + 1: zeros); the blocks' sums, G rows to a register
struct XPairs {
  std::vector<int16_t> a;
  std::vector<float> dx, sum;
  int64_t nb, np;  // blocks, pairs of blocks

  XPairs(const XBlocks& x, int64_t rows, int64_t K, int64_t G)
      : a(rows * ((K / QK + 1) / 2) * 64), dx(rows * ((K / QK + 1) / 2) * 16), sum((rows + G - 1) / G * (K / QK) * 16),
        nb(K / QK), np((K / QK + 1) / 2) {
    at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t bp = b / 2, side = b % 2;
          int16_t* dst = a.data() + (m * np + bp) * 64;
          const int16_t* src = x.a.data() + (m * nb + b) * QK;
          for (int j = 0; j < 16; ++j) dst[side * 16 + j] = src[j], dst[32 + side * 16 + j] = src[16 + j];
          for (int j = 0; j < 8; ++j) dx[(m * np + bp) * 16 + side * 8 + j] = x.dx[m * nb + b];
          sum[((m / G) * nb + b) * 16 + m % G] = x.xsum[m * nb + b];
        }
    });
  }
};

// a chunk of W's rows decoded: per row and pair of blocks, the int16 weights as XPairs holds x's and the
// scales [d_b x8 | d_b+1 x8]; per row and block, the offset m (Q4_1's, Q4_0's -8 d)
template <int64_t Type>
struct WPairs {
  std::vector<int16_t> q;
  std::vector<float> d, m;
  int64_t nb, np;

  WPairs(int64_t rows, int64_t K) : q(rows * ((K / QK + 1) / 2) * 64), d(rows * ((K / QK + 1) / 2) * 16),
                                    m(rows * (K / QK)), nb(K / QK), np((K / QK + 1) / 2) {}

  void decode(const uint8_t* w, int64_t rows) {
    constexpr int64_t BB = BLOCK32_BYTES<Type>;
    constexpr int off = Type == Q4_1 ? 4 : 2;
    for (int64_t n = 0; n < rows; ++n) {
      const uint8_t* row = w + n * nb * BB;
      for (int64_t bp = 0; bp < np; ++bp) {
        const uint8_t* blk = row + 2 * bp * BB;
        const bool two = 2 * bp + 1 < nb;
        const __m128i z = _mm_setzero_si128();
        __m512i lo, hi;
        if constexpr (Type == Q8_0) {
          const __m128i l0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off));
          const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off + 16));
          const __m128i l1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + BB + off)) : z;
          const __m128i h1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + BB + off + 16)) : z;
          lo = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(l0), l1, 1));
          hi = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1));
        } else {
          const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off));
          const __m128i b1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + BB + off)) : z;
          const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1));
          lo = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
          hi = _mm512_srli_epi16(bytes, 4);
        }
        _mm512_storeu_si512(q.data() + (n * np + bp) * 64, lo);
        _mm512_storeu_si512(q.data() + (n * np + bp) * 64 + 32, hi);
        const float d0 = half_at(blk), d1 = two ? half_at(blk + BB) : 0.f;
        _mm512_storeu_ps(d.data() + (n * np + bp) * 16, _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1));
        for (int64_t b = 2 * bp; b < std::min(nb, 2 * bp + 2); ++b) {
          const uint8_t* one = row + b * BB;
          m[n * nb + b] = block_offset<Type>(one);
        }
      }
    }
  }
};

// MR rows of x (from row `row`) against R decoded rows of W (from `n`): hsum(even + odd) + offsets + bias
template <int MR, int R, int64_t Type>
void qtile16(const XPairs& x, int64_t row, const WPairs<Type>& w, int64_t n, const float* offsets, int lane,
             float* out, int64_t ldo, const float* bias) {
  __m512 acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  // pair bp of blocks into the accumulators; `two`: both blocks (else the even one alone, its half only)
  auto add_pair = [&](int64_t bp, bool two) {
    __m512i lo[R], hi[R];
    __m512 d[R];
    for (int r = 0; r < R; ++r) {
      const int16_t* q = w.q.data() + ((n + r) * w.np + bp) * 64;
      lo[r] = _mm512_loadu_si512(q), hi[r] = _mm512_loadu_si512(q + 32);
      d[r] = _mm512_loadu_ps(w.d.data() + ((n + r) * w.np + bp) * 16);
    }
    for (int i = 0; i < MR; ++i) {
      const int16_t* a = x.a.data() + ((row + i) * x.np + bp) * 64;
      const __m512i alo = _mm512_loadu_si512(a), ahi = _mm512_loadu_si512(a + 32);
      const __m512 dx = _mm512_loadu_ps(x.dx.data() + ((row + i) * x.np + bp) * 16);
      for (int r = 0; r < R; ++r) {
#ifdef __AVX512VNNI__
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo[r], alo), hi[r], ahi);
#else
        const __m512i dot = _mm512_add_epi32(_mm512_madd_epi16(lo[r], alo), _mm512_madd_epi16(hi[r], ahi));
#endif
        const __m512 sum = _mm512_fmadd_ps(_mm512_mul_ps(d[r], dx), _mm512_cvtepi32_ps(dot), acc[i][r]);
        acc[i][r] = two ? sum : _mm512_mask_mov_ps(acc[i][r], 0x00FF, sum);
      }
    }
  };
  const int64_t whole = x.nb / 2;  // pairs with both blocks; an odd last block alone after them
  for (int64_t bp = 0; bp < whole; ++bp) add_pair(bp, true);
  if (whole < x.np) add_pair(whole, false);
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) {
      const V8 even = {_mm512_castps512_ps256(acc[i][r])}, odd = {_mm512_extractf32x8_ps(acc[i][r], 1)};
      out[i * ldo + r] = hsum(add(even, odd)) + offsets[r * 16 + lane + i] + (bias ? bias[r] : 0.f);
    }
}

template <int64_t Type>
using QTile16 = void (*)(const XPairs&, int64_t, const WPairs<Type>&, int64_t, const float*, int, float*, int64_t,
                         const float*);
template <int MR, int64_t Type>
constexpr QTile16<Type> QTILES16_ROW[4] = {qtile16<MR, 1, Type>, qtile16<MR, 2, Type>, qtile16<MR, 3, Type>,
                                           qtile16<MR, 4, Type>};
template <int64_t Type>  // [rows of x - 1][rows of W - 1]
constexpr const QTile16<Type>* QTILES16[4] = {QTILES16_ROW<1, Type>, QTILES16_ROW<2, Type>, QTILES16_ROW<3, Type>,
                                             QTILES16_ROW<4, Type>};

template <int64_t Type>
void qgemm16(float* op, const XBlocks& xq, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const float* bias) {
  constexpr int MR = 3, R = 4;  // 12 accumulators, 12 registers of W and 3 of x: within the 32 (measured
                                // against 4 x 3 and 2 x 4 on an AVX512 Xeon)
  constexpr int64_t G = 16 / MR * MR;  // rows of x to a group: the offsets' register holds theirs
  const XPairs x(xq, M, K, G);
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(Type);
  const int64_t chunk = std::max<int64_t>(R, (int64_t(128) << 10) / (x.np * 192) / R * R);  // ~128 KB decoded
  at::parallel_for(0, (N + R - 1) / R, 4, [&](int64_t b, int64_t e) {
    const int64_t n_lo = b * R, n_hi = std::min(N, e * R);
    WPairs<Type> w(chunk, K);
    std::vector<float> offsets(chunk * 16);  // per row of W in the chunk: its m sum(x), a lane per row of x
    for (int64_t c0 = n_lo; c0 < n_hi; c0 += chunk) {
      const int64_t c1 = std::min(n_hi, c0 + chunk);
      w.decode(wp + c0 * row_bytes, c1 - c0);
      for (int64_t g = 0; g < M; g += G) {
        // the offsets: even blocks' and odd blocks' products summed apart, in block order, then added
        for (int64_t n = 0; n < c1 - c0; ++n) {
          __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
          if constexpr (Type != Q8_0)
            for (int64_t blk = 0; blk < nb; ++blk) {
              const __m512 xs = _mm512_loadu_ps(x.sum.data() + ((g / G) * nb + blk) * 16);
              const __m512 p = _mm512_mul_ps(_mm512_set1_ps(w.m[n * nb + blk]), xs);
              if (blk % 2) odd = _mm512_add_ps(odd, p); else even = _mm512_add_ps(even, p);
            }
          _mm512_storeu_ps(offsets.data() + n * 16, _mm512_add_ps(even, odd));
        }
        for (int64_t m = g; m < std::min(M, g + G); m += MR) {
          const int mr = int(std::min<int64_t>(MR, M - m));
          for (int64_t n = 0; n < c1 - c0; n += R) {
            const int nr = int(std::min<int64_t>(R, c1 - c0 - n));
            QTILES16<Type>[mr - 1][nr - 1](x, m, w, n, offsets.data() + n * 16, int(m - g), op + m * N + c0 + n, N,
                                           bias ? bias + c0 + n : nullptr);
          }
        }
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(ATOM_ELEMENTWISE_AVX512)
// Past 32 rows on AVX2, Q4_0/Q4_1/Q8_0 blocks with qgemv_rows' arithmetic as a tiled GEMM: W's rows
// decoded once per chunk (int16 weights, scales, offsets) and every pair of x's rows passes over them,
// four rows of W at a time: x's two rows of a block in registers, W's read by the multiplies. Each (row
// of x, row of W) keeps qgemv_rows' two chains, the even blocks' accumulator and the odd blocks', each
// fed by the same fma of the same d dx and the same eight int32 lanes of block_dot, in block order: a
// row of x's four scales for a block come from one product of [d0 d1 d2 d3] and [dx] (IEEE products: the
// scalar's bits) and an in-lane broadcast each. A tile runs the even chain, then the odd one; the end is
// the same hsum(even + odd) + (offsets) + bias. The offsets m sum(x) are the same products and sums,
// eight rows of x to a register. Row counts that do not fill a tile run with zero rows beside the last
// (their sums are never stored).

// x's scales per row and block, eight times (a multiplier from memory), and the blocks' sums, G rows to a
// register
struct XScales8 {
  Lines<float> dx, sum;

  XScales8(const XBlocks& x, int64_t rows, int64_t nb, int64_t G)
      : dx((rows + 1) / 2 * 2 * nb * 8), sum((rows + G - 1) / G * nb * 8) {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        std::fill_n(dx.data() + (m * nb + b) * 8, 8, x.dx[m * nb + b]);
        sum[((m / G) * nb + b) * 8 + m % G] = x.xsum[m * nb + b];
      }
  }
};

// a chunk of W's rows decoded (zero rows up to a multiple of four): per row and block the 32 int16
// weights; per four rows and block [d0 d1 d2 d3] twice; per row and block the offset m
template <int64_t Type>
struct WBlocks8 {
  static constexpr int64_t R = 4;
  Lines<int16_t> q;
  Lines<float> d;
  std::vector<float> m;
  int64_t nb;

  WBlocks8(int64_t rows, int64_t K)
      : q((rows + R - 1) / R * R * K), d((rows + R - 1) / R * (K / QK) * 8), m(rows * (K / QK)), nb(K / QK) {}

  void decode(const uint8_t* w, int64_t rows) {
    constexpr int64_t BB = BLOCK32_BYTES<Type>;
    auto set_scale = [&](int64_t n, int64_t b, float v) {  // row n's lane in both halves of its four's scales
      float* four = d.data() + ((n / R) * nb + b) * 8;
      four[n % R] = four[4 + n % R] = v;
    };
    for (int64_t n = rows; n % R; ++n) {  // the zero rows after the last
      std::fill_n(q.data() + n * nb * QK, nb * QK, int16_t(0));
      for (int64_t b = 0; b < nb; ++b) set_scale(n, b, 0.f);
    }
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (n * nb + b) * BB;
        const Weights16 q16 = block_weights<Type>(blk);
        int16_t* dst = q.data() + (n * nb + b) * QK;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), q16.lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), q16.hi);
        set_scale(n, b, half_at(blk));
        m[n * nb + b] = block_offset<Type>(blk);
      }
  }
};

// rows x0, x0 + 1 of x against decoded rows w0 .. w0 + 3 of W: each pair's hsum(even + odd) into sums[i][r]
template <int64_t Type>
inline void qtile8(const XBlocks& x, const XScales8& xs, int64_t x0, const WBlocks8<Type>& w, int64_t w0,
                   float sums[2][4]) {
  const int64_t nb = w.nb;
  const int16_t* xa = x.a.data() + x0 * nb * QK;
  const int16_t* wq = w.q.data() + w0 * nb * QK;
  const float* dx = xs.dx.data() + x0 * nb * 8;
  const float* dw = w.d.data() + (w0 / 4) * nb * 8;
  __m256 even[2][4];
  for (int p = 0; p < 2; ++p) {
    __m256 acc[2][4];
    for (int i = 0; i < 2; ++i)
      for (int r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int64_t b = p; b < nb; b += 2) {
      auto at = [&](const int16_t* base, int64_t row, int h) {
        return _mm256_load_si256(reinterpret_cast<const __m256i*>(base + (row * nb + b) * QK + 16 * h));
      };
      __m256i xl0 = at(xa, 0, 0), xh0 = at(xa, 0, 1), xl1 = at(xa, 1, 0), xh1 = at(xa, 1, 1);
      asm("" : "+x"(xl0), "+x"(xh0), "+x"(xl1), "+x"(xh1));  // x's operands stay in registers
      const __m256 d = _mm256_load_ps(dw + b * 8);
      for (int i = 0; i < 2; ++i) {
        const __m256 s = _mm256_mul_ps(d, _mm256_load_ps(dx + (i * nb + b) * 8));
        const __m256i xl = i ? xl1 : xl0, xh = i ? xh1 : xh0;
        auto lanes = [&](int r) {
          return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(at(wq, r, 0), xl), _mm256_madd_epi16(at(wq, r, 1), xh)));
        };
        acc[i][0] = _mm256_fmadd_ps(_mm256_permute_ps(s, 0x00), lanes(0), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(_mm256_permute_ps(s, 0x55), lanes(1), acc[i][1]);
        acc[i][2] = _mm256_fmadd_ps(_mm256_permute_ps(s, 0xAA), lanes(2), acc[i][2]);
        acc[i][3] = _mm256_fmadd_ps(_mm256_permute_ps(s, 0xFF), lanes(3), acc[i][3]);
      }
    }
    for (int i = 0; i < 2; ++i)
      for (int r = 0; r < 4; ++r)
        if (p == 0) even[i][r] = acc[i][r];
        else sums[i][r] = hsum(add(V8{even[i][r]}, V8{acc[i][r]}));
  }
}

template <int64_t Type>
void qgemm8(float* op, const XBlocks& xq, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const float* bias) {
  constexpr int64_t G = 8, R = WBlocks8<Type>::R;  // rows of x to a register of offsets; rows of W to a tile
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(Type);
  const XScales8 xs(xq, M, nb, G);
  const int64_t decoded_row = nb * (QK * 2 + 8 * 4 / R + 4);
  const int64_t chunk = std::max<int64_t>(R, (int64_t(128) << 10) / decoded_row / R * R);  // ~128 KB decoded
  at::parallel_for(0, (N + R - 1) / R, 2, [&](int64_t b, int64_t e) {
    const int64_t n_lo = b * R, n_hi = std::min(N, e * R);
    WBlocks8<Type> w(chunk, K);
    std::vector<float> offsets(chunk * 8);  // per row of W in the chunk: its m sum(x), a lane per row of x
    for (int64_t c0 = n_lo; c0 < n_hi; c0 += chunk) {
      const int64_t c1 = std::min(n_hi, c0 + chunk);
      w.decode(wp + c0 * row_bytes, c1 - c0);
      for (int64_t g = 0; g < M; g += G) {
        // the offsets: even blocks' and odd blocks' products summed apart, in block order, then added
        for (int64_t n = 0; n < c1 - c0; ++n) {
          __m256 ev = _mm256_setzero_ps(), od = _mm256_setzero_ps();
          if constexpr (Type != Q8_0)
            for (int64_t blk = 0; blk < nb; ++blk) {
              const __m256 p = _mm256_mul_ps(_mm256_set1_ps(w.m[n * nb + blk]),
                                             _mm256_loadu_ps(xs.sum.data() + ((g / G) * nb + blk) * 8));
              if (blk % 2) od = _mm256_add_ps(od, p); else ev = _mm256_add_ps(ev, p);
            }
          _mm256_storeu_ps(offsets.data() + n * 8, _mm256_add_ps(ev, od));
        }
        // four rows of W stay in L1 while the group's pairs of x (in L1 too) pass over them
        for (int64_t n = 0; n < c1 - c0; n += R)
          for (int64_t m = g; m < std::min(M, g + G); m += 2) {
            float sums[2][R];
            qtile8<Type>(xq, xs, m, w, n, sums);
            for (int i = 0; i < std::min<int64_t>(2, M - m); ++i)
              for (int r = 0; r < std::min<int64_t>(R, c1 - c0 - n); ++r) {
                const int64_t col = c0 + n + r;
                op[(m + i) * N + col] = sums[i][r] + offsets[(n + r) * 8 + (m + i - g)] + (bias ? bias[col] : 0.f);
              }
          }
      }
    }
  });
}
#endif

// Any number of rows, each output element by the arithmetic of the 1-4 row GEMV whatever M is: the rows
// four at a time through the same code (a row's sums never meet another row's), or past four rows the
// sixteen-lane form of the same arithmetic where the CPU has AVX512 (qgemm16), past 32 the tiled
// form on AVX2 (qgemm8): batch-invariant by construction. Each thread takes a range of W's rows in
// chunks that stay in cache (~64 KB) while every group of x's rows passes over them.
template <int64_t Type>
void qgemm_impl(float* op, const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const float* bias) {
#if defined(ATOM_ELEMENTWISE_AVX512) && defined(__AVX2__) && defined(__FMA__)
  const XBlocks xq(xp, M, K);
  if constexpr (!is_k_quant(Type))
    if (M > 4) return qgemm16<Type>(op, xq, M, K, wp, N, bias);
#elif defined(__AVX2__) && defined(__FMA__)
  // past 32 rows: up to there the four-row groups below, which decode W in registers, take as long or
  // less (SmolLM2's four linears, Q4_1, on an AMD EPYC Zen 3, 2 threads, best of 3, 2026-12-07: 9 rows
  // 0.67 ms against the tiles' 0.93, 32 rows 2.29 against 2.26, 580 rows 44.2 against 32.3, 2048 rows
  // 153 against 114)
  const bool tiled = !is_k_quant(Type) && M > 32;
  const XBlocks xq(xp, M, K, tiled ? (M + 1) / 2 * 2 : M);  // the tiles take rows in pairs
  if constexpr (!is_k_quant(Type))
    if (tiled) return qgemm8<Type>(op, xq, M, K, wp, N, bias);
#else
  const XBlocks xq(xp, M, K);
#endif
  const int64_t chunk = std::max<int64_t>(4, (int64_t(64) << 10) / (K / weights_per_block(Type) * block_bytes(Type)));
  at::parallel_for(0, N, M <= 4 ? 16 : std::min<int64_t>(chunk, 16), [&](int64_t b, int64_t e) {
    for (int64_t n0 = b; n0 < e; n0 += chunk) {
      const int64_t n1 = std::min(e, n0 + chunk);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) gemv_group<4, Type>(xq, m, K, wp, op, N, bias, n0, n1);
      switch (M - m) {
        case 3: gemv_group<3, Type>(xq, m, K, wp, op, N, bias, n0, n1); break;
        case 2: gemv_group<2, Type>(xq, m, K, wp, op, N, bias, n0, n1); break;
        case 1: gemv_group<1, Type>(xq, m, K, wp, op, N, bias, n0, n1); break;
      }
    }
  });
}

void check_weight(const at::Tensor& w, int64_t K, int64_t type, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), name,
              ": the weight must be contiguous uint8 [N, row bytes]");
  const int64_t per_block = weights_per_block(type);
  TORCH_CHECK(K % per_block == 0 && w.size(1) == K / per_block * block_bytes(type), name, ": K = ", K,
              " does not match the weight's ", w.size(1), " bytes per row");
}

template <int64_t Type, typename T>
void dequantize_rows(const uint8_t* w, T* out, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t BB = BLOCK32_BYTES<Type>;
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      Block<Type> blk;
      decode<Type>(w + (n * nb + b) * BB, blk);
      const V8 d = splat(blk.d), m = splat(blk.m);
      // the reference's two roundings: d q, then + m
      for (int i = 0; i < 4; ++i) store_as(out + n * K + b * QK + 8 * i, add(mul(d, blk.q[i]), m));
    }
  }
}

template <int64_t Type, typename T>
void kdequantize_rows(const uint8_t* w, T* out, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t BB = Type == Q4_K ? 144 : 210;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t sb = 0; sb < K / QKK; ++sb) {
      const uint8_t* blk = w + (n * (K / QKK) + sb) * BB;
      SubScales s[8];
      super_block_scales<Type>(blk, s);
      for (int j = 0; j < 8; ++j) {
        V8 q[4];
        weights_to_float(sub_block_weights<Type>(blk, j), q);
        for (int i = 0; i < 4; ++i) {
          const V8 d = mul(splat(i < 2 ? s[j].s : s[j].s2), q[i]);  // the reference's d sc q, then - dmin mn
          store_as(out + n * K + (sb * 8 + j) * QK + 8 * i, Type == Q4_K ? add(d, splat(s[j].m)) : d);
        }
      }
    }
  }
}

template <typename T>
void dequantize_range(const uint8_t* wp, T* op, int64_t K, int64_t type, int64_t b, int64_t e) {
  switch (type) {
    case Q4_0: return dequantize_rows<Q4_0>(wp, op, K, b, e);
    case Q4_1: return dequantize_rows<Q4_1>(wp, op, K, b, e);
    case Q8_0: return dequantize_rows<Q8_0>(wp, op, K, b, e);
    case Q4_K: return kdequantize_rows<Q4_K>(wp, op, K, b, e);
    case Q6_K: return kdequantize_rows<Q6_K>(wp, op, K, b, e);
  }
}

template <typename T>
struct Dequantize {
  static void run(at::Tensor& out, const at::Tensor& w, int64_t type) {
    const int64_t K = out.size(1);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, w.size(0), 16, [&](int64_t b, int64_t e) { dequantize_range(wp, op, K, type, b, e); });
  }
};

}  // namespace

namespace atom::op {

// bfloat16 x is widened to float32 (exactly) and the float32 result rounded back as torch's .to() rounds: the
// bits of the float32 call between two conversions, without their two Python-level ops per linear
void qgemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t type,
           const c10::optional<at::Tensor>& b) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && out.scalar_type() == dtype,
              "qgemv: float32 or bfloat16 activations, and out of their dtype");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "qgemv: tensors must be contiguous");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "qgemv: x must be [M >= 1, K]");
  check_weight(w, x.size(1), type, "qgemv");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "qgemv: out must be [M, N]");
  const at::Tensor bias = b.has_value() ? b->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor of = dtype == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  atom::qgemv_f32(of.data_ptr<float>(), xf.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<uint8_t>(), w.size(0),
                  type, bias.defined() ? bias.data_ptr<float>() : nullptr);
  if (dtype != at::kFloat) out.copy_(of);
}

void dequantize(at::Tensor& out, const at::Tensor& w, int64_t type) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == w.size(0), "dequantize: out must be [N, K]");
  check_weight(w, out.size(1), type, "dequantize");
  dispatch<Dequantize>(out.scalar_type(), "dequantize", out, w, type);
}

}  // namespace atom::op

namespace atom {

int64_t quant_row_bytes(int64_t type, int64_t K) { return K / weights_per_block(type) * block_bytes(type); }

void qgemv_f32(float* out, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t type,
               const float* bias) {
  switch (type) {
    case Q4_0: return qgemm_impl<Q4_0>(out, x, M, K, w, N, bias);
    case Q4_1: return qgemm_impl<Q4_1>(out, x, M, K, w, N, bias);
    case Q8_0: return qgemm_impl<Q8_0>(out, x, M, K, w, N, bias);
    case Q4_K: return qgemm_impl<Q4_K>(out, x, M, K, w, N, bias);
    case Q6_K: return qgemm_impl<Q6_K>(out, x, M, K, w, N, bias);
    default: block_bytes(type);
  }
}

void dequantize_f32(float* out, const uint8_t* w, int64_t rows, int64_t K, int64_t type) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) { dequantize_range(w, out, K, type, b, e); });
}

}  // namespace atom
