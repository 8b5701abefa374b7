// The AMX variant of the paged attention, for a bfloat16 cache (decodes and prefill units): both
// products on the tile unit, which does a 16 x 16 x 32 block in the time AVX-512 does a few
// hundred pair dot products (on a 2-core Xeon with AMX: 1.6 TMAC/s against 30 GMAC/s for
// vdpbf16ps), no key or value staged:
// - scores transposed, S^T = K Q^T: the keys, 16 of a chunk straight from the cache, are the A
//   tile (rows: keys, 32 dims a tile), the queries of the kv head as dim pairs (prepared once) B;
// - the softmax of AMX_CHUNKS chunks at once, one lane per query row, its probabilities
//   transposed to rows of 16 keys;
// - O += P V with the values straight from the cache as B (rows: keys, 16 dim pairs a row): the
//   tile unit sums over pairs (key, dim parity), so P goes in twice, as the even halves of dwords
//   (the other half zero: the even dims out) and as the odd halves (the odd dims out).
// Probabilities are rounded to bfloat16 before P.V, as in the AVX-512 variant; their sum is not.
// Included where the build targets AMX-BF16 (a Xeon since Sapphire Rapids); runs where the OS
// lends the tiles and the shape fits (Amx::fits); its twin is the portable (AVX2) variant.
#pragma once

#ifndef ATOM_AMX_BF16
#error "attention_amx.h needs a build that targets AMX-BF16"
#endif

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"
#include "attention_avx512_bf16.h"  // transpose16
#include "attention_loop.h"

namespace atom::attention {

constexpr int AMX_CHUNKS = 8;  // chunks of 16 keys per softmax step
constexpr int AMX_ROWS = 64;   // a prefill unit's rows per kv head: four blocks of 16 share each key read

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
inline void amx_attend(AmxScratch& w, const c10::BFloat16* q, int nt, int pos0, const c10::BFloat16* kc,
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

struct Amx {
  using T = c10::BFloat16;

  struct Scratch : AmxScratch {
    Scratch(const Problem<T>& p, int) : AmxScratch(p.H, p.KVH, p.D) {}
  };

  // whether the tiles serve a call of this shape (and the OS lends them)
  static bool fits(const Problem<T>& p) { return amx_fits(p.H, p.KVH, p.D, p.BS); }

  static int unit_tokens(int G) { return std::max(1, AMX_ROWS / G); }
  static constexpr bool ROW_RANGES = false;  // the tiles take every row of a unit at once

  // Batch-invariant on the tiles (`partition`, a multiple of 128): a row's products, its softmax
  // steps of 128 keys and their lanes' sums are the same in a decode and in any prefill tile, the
  // keys a row does not see adding exact zeros. So a unit's keys start at a step's edge: the keys
  // before its window that it adds are whole steps it does not see, exact no-ops.
  static int first_key(int lo, const Problem<T>& p) {
    return p.partition > 0 ? lo / (AMX_CHUNKS * 16) * (AMX_CHUNKS * 16) : lo;
  }

  static void attend(Scratch& s, const Problem<T>& p, const Unit& u, const Span& span, Rows rows) {
    amx_attend(s, p.q + (int64_t(p.qstart[u.seq]) + u.q_begin) * p.H * p.D, u.tokens(),
               p.first_pos(u.seq) + u.q_begin, p.k, p.v, p.slot_stride, p.tables + int64_t(u.seq) * p.max_blocks,
               p.BS, span.lo, span.hi, span.fetch_hi, span.fetched, p.window, p.scale, rows.m, rows.l, rows.o);
  }
};

}  // namespace atom::attention
