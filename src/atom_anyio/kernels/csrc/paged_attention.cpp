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
// attention_loop.h holds that loop, once; a variant attends a unit's rows
// over a span of keys, one file each: portable (V8, any element type),
// AVX2 (the portable one plus a decode's scores from the keys as they lie),
// AVX512-BF16 (bfloat16 pair dot products; over an fp8 cache, a decode's keys and values widened in
// registers, a prefill's chunks to bfloat16 in L1) and AMX (the tiles; bfloat16 caches only). This file
// checks the op's arguments and picks the variant, once a call.

#include <ATen/core/Tensor.h>

#include "attention_loop.h"
#include "attention_portable.h"
#include "kernels.h"
#include "vec.h"
#if defined(__AVX2__) && defined(__FMA__)
#include "attention_avx2.h"
#endif
#ifdef ATOM_AVX512_BF16
#include "attention_avx512_bf16.h"
#endif
#ifdef ATOM_AMX_BF16
#include "attention_amx.h"
#endif

namespace {

using namespace atom::attention;

// The variant for a call, picked once, outside the loop: bfloat16 takes the AMX tiles where the
// build has them, the OS lends them, `amx` is on and the shape fits, else AVX512-BF16 where
// built (over an fp8 cache: its chunks widened to bfloat16 first); with `native` off (the portable
// twins), or another element type, the portable code runs (with AVX2's decode scores where built).
template <typename T, typename C>
void run_variant(const Problem<T, C>& p, bool native, bool amx) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
#ifdef ATOM_AMX_BF16
    if (native && amx && Amx::fits(p)) return attention_loop<Amx>(p);
#endif
#ifdef ATOM_AVX512_BF16
    if (native) return attention_loop<Avx512Bf16>(p);
#endif
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#ifdef ATOM_AVX512_BF16
    if (native && Avx512Bf16Fp8<C>::fits(p)) return attention_loop<Avx512Bf16Fp8<C>>(p);
#endif
  }
#if defined(__AVX2__) && defined(__FMA__)
  attention_loop<Avx2<T, C>>(p);
#else
  attention_loop<Portable<T, C>>(p);
#endif
}

template <typename T>
struct PagedAttention {
  static void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                  int64_t block_size, double scale, int64_t sliding_window, const float* sinks, int64_t partition,
                  bool native, bool amx) {
    const auto cache = k_cache.scalar_type();
    if (cache == q.scalar_type())
      return run_with<T>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start, block_size, scale,
                         sliding_window, sinks, partition, native, amx);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
      if (cache == at::kFloat8_e5m2)
        return run_with<c10::Float8_e5m2>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start, block_size,
                                          scale, sliding_window, sinks, partition, native, amx);
      if (cache == at::kFloat8_e4m3fn)
        return run_with<c10::Float8_e4m3fn>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start,
                                            block_size, scale, sliding_window, sinks, partition, native, amx);
    }
    TORCH_CHECK(false, "paged_attention: the caches must be q's dtype, or float8_e5m2 or float8_e4m3fn under float32 "
                "or bfloat16 queries, not ", cache, " under ", q.scalar_type());
  }

  template <typename C>
  static void run_with(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                       int64_t block_size, double scale, int64_t sliding_window, const float* sinks,
                       int64_t partition, bool native, bool amx) {
    Problem<T, C> p;
    p.q = q.data_ptr<T>(), p.out = out.data_ptr<T>();
    p.k = static_cast<const C*>(k_cache.data_ptr()), p.v = static_cast<const C*>(v_cache.data_ptr());
    p.tables = block_tables.data_ptr<int>(), p.lens = seq_lens.data_ptr<int>();
    p.qstart = query_start.data_ptr<int>();
    p.H = q.size(1), p.KVH = k_cache.size(1), p.G = p.H / p.KVH, p.D = q.size(2);
    p.B = seq_lens.size(0), p.max_blocks = block_tables.size(1), p.BS = block_size;
    p.slot_stride = int64_t(p.KVH) * p.D;
    p.scale = float(scale), p.window = int(sliding_window), p.partition = int(partition), p.sinks = sinks;
    run_variant(p, native, amx);
  }
};

}  // namespace

// out[t, h] = softmax(q[t, h] . K^T * scale) V over the causal context of
// t's sequence (its last sliding_window keys when sliding_window > 0), K and
// V read from the paged cache through block_tables. sinks (float32 [H]):
// one logit per head that joins the softmax denominator only. partition > 0:
// the keys are split at its multiples whatever the batch, so each row's
// result is the same bits alone, batched, or in any prefill chunk. native, amx: which variant runs
// (run_variant). The caches are q's dtype, or fp8 (kv_cache_dtype: float8_e5m2 or float8_e4m3fn,
// unscaled) under float32 or bfloat16 queries.
void atom::op::paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start, int64_t block_size, double scale,
                               int64_t sliding_window, const c10::optional<at::Tensor>& sinks, int64_t partition,
                               bool native, bool amx) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: the caches must be of one dtype and shape");
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
  atom::dispatch<PagedAttention>(q.scalar_type(), "paged_attention", out, q, k_cache, v_cache, block_tables, seq_lens,
                                 query_start, block_size, scale, sliding_window, sink_logits, partition,
                                 native, amx);
}

// The AVX512-BF16 variant's fp8 widening (its registers' path), for the tests: `bytes` (uint8, a
// multiple of 64) as the bfloat16 words its dot products read, into `out` in the bytes' order (int16,
// as many; the value times 2^-112 for e5m2, 2^-120 for e4m3), by the affine form (GFNI) or by the
// shift and the and
void atom::op::fp8_bf16_words(at::Tensor& out, const at::Tensor& bytes, bool e5m2, bool affine) {
  TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.is_contiguous() && bytes.numel() % 64 == 0,
              "fp8_bf16_words: bytes must be contiguous uint8, a multiple of 64");
  TORCH_CHECK(out.scalar_type() == at::kShort && out.is_contiguous() && out.numel() == bytes.numel(),
              "fp8_bf16_words: out must be contiguous int16, as many as the bytes");
#ifdef ATOM_AVX512_BF16
  const auto* b = bytes.data_ptr<uint8_t>();
  auto* o = out.data_ptr<int16_t>();
  const int64_t n = bytes.numel();
  if (affine) {
    TORCH_CHECK(FP8_AFFINE, "fp8_bf16_words: this build has no GFNI");
#ifdef __GFNI__
    e5m2 ? fp8_words_in_order<c10::Float8_e5m2, true>(b, n, o) : fp8_words_in_order<c10::Float8_e4m3fn, true>(b, n, o);
#endif
  } else {
    e5m2 ? fp8_words_in_order<c10::Float8_e5m2, false>(b, n, o) : fp8_words_in_order<c10::Float8_e4m3fn, false>(b, n, o);
  }
#else
  TORCH_CHECK(false, "fp8_bf16_words: this build has no AVX512-BF16");
#endif
}
