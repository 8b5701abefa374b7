// The paged attention's one loop, for every variant (attention_portable.h, attention_avx2.h,
// attention_avx512_bf16.h, attention_amx.h): the step cut in units, each unit's keys in
// partitions, the partitions' partial results merged in order (flash-decoding), and the
// rows normalised into the output. A variant V only attends: a unit's rows over a span of
// keys, as an online softmax (running max m, sum l, unnormalised output o). It gives:
//
//   V::Scratch(p, max_rows)        a thread's buffers for the call p
//   V::unit_tokens(G)              the query tokens a unit holds (every head of each)
//   V::first_key(lo, p)            where a unit's keys start, given the first any of its rows sees
//   V::attend(s, p, u, span, rows) rows.m, .l, .o of unit u over span's keys, from (-inf, 0, 0)
//
// The vector variants attend alike (attend_in_chunks, below: the keys in chunks of 16, a kv
// head at a time) and give that walk its steps instead (struct Chunked).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

#include "vec.h"

namespace atom::attention {

constexpr int KW = 16;              // keys per chunk (the vector variants); head_dim is a multiple of it
constexpr int PREFETCH_CHUNKS = 4;  // how far ahead the vector variants fetch the next chunks into L2

// One call: the step's tensors as pointers, and its shapes. T: q's and out's element type; C: the
// caches' (T, or an fp8 type: kv_cache_dtype)
template <typename T, typename C = T>
struct Problem {
  const T* q;          // [tokens, H, D]
  const C *k, *v;      // the caches [slots, KVH, D]
  T* out;              // [tokens, H, D]
  const int *tables, *lens, *qstart;  // block tables [B][max_blocks], context lengths [B], query starts [B + 1]
  int H, KVH, G, D, B, max_blocks, BS;
  int64_t slot_stride;  // KVH * D: a slot's row
  float scale;
  int window;          // 0: the whole causal context
  int partition;       // 0: keys split only to keep the threads busy; > 0: at its multiples (batch-invariant)
  const float* sinks;  // float32 [H] or null

  // the position of the sequence's first query token
  int first_pos(int seq) const { return lens[seq] - (qstart[seq + 1] - qstart[seq]); }
};

struct Unit {
  int seq, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence, every head
  int key_lo, key_hi;       // the keys any of them sees: [key_lo, key_hi), key_lo at a block start
  int tokens() const { return q_end - q_begin; }
};

// The keys one attend call covers, [lo, hi), for the unit's rows [r_lo, r_hi) (every row unless
// the variant takes row ranges: V::ROW_RANGES). The caller reads on to fetch_hi next (a unit's next
// partition on this thread), and `fetched` says the previous call fetched these keys ahead.
struct Span {
  int lo, hi, fetch_hi;
  bool fetched;
  int r_lo, r_hi;
};

// a unit's rows (kv head major, then query token, then head of the group): running max, sum and
// unnormalised output [rows][D]
struct Rows {
  float *m, *l, *o;
};

template <class V, typename T, typename C>
void attention_loop(const Problem<T, C>& p) {
  const int H = p.H, D = p.D, G = p.G, BS = p.BS, window = p.window;
  // A unit is a tile of one sequence's query tokens with all its heads, so a chunk of KV
  // (consecutive slots, every head) is read once, in one piece.
  const int tile = V::unit_tokens(G);
  std::vector<Unit> units;
  int max_span = 0;
  for (int b = 0; b < p.B; ++b) {
    const int nq = p.qstart[b + 1] - p.qstart[b], first_pos = p.first_pos(b);
    for (int i = 0; i < nq; i += tile) {
      const int q_end = std::min(nq, i + tile), hi = first_pos + q_end;  // causal bound of the tile
      const int lo = window > 0 ? std::max(0, first_pos + i - window + 1) / BS * BS : 0;  // chunks before: skipped
      units.push_back({b, i, q_end, V::first_key(lo, p), hi});
      max_span = std::max(max_span, hi - units.back().key_lo);
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
  const int fixed = p.partition;
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
  int part_rows = 0;  // a partial's rows: the most any unit of this call has (a decode's H)
  for (const Unit& u : units) part_rows = std::max(part_rows, u.tokens() * H);
  // one task per item when the units alone cannot keep the threads busy, else one per unit
  // (its partitions in order, merged in the task: no partials kept for the whole step)
  const bool per_item = merged && num_units < 4 * threads;
  // Fixed partitions leave a short context's decode one item, one thread's work while the others
  // wait (SmolLM2 at 600 keys on a Zen 3: 11.4 ms a token against 9.6 split in halves). A
  // variant that takes row ranges then splits each item's rows over tasks, so that the tasks
  // divide evenly over the threads: a row's arithmetic is its own whichever rows share its
  // call, so its bits are the same (each kv head a cut crosses is read by both sides).
  int row_groups = 1;
  if (fixed > 0 && per_item && V::ROW_RANGES && int(items.size()) < 4 * threads) {
    row_groups = threads / std::gcd(int(items.size()), threads);
    for (const Unit& u : units) row_groups = std::min(row_groups, u.tokens() * H);
  }
  struct Task {
    int item, r_lo, r_hi;
  };
  std::vector<Task> tasks;  // per unit: its row groups, each group's partitions in order
  if (per_item)
    for (int ui = 0; ui < num_units; ++ui) {
      const int rows = units[ui].tokens() * H;
      for (int g = 0; g < row_groups; ++g)
        for (int it = first_item[ui]; it < first_item[ui + 1]; ++it)
          tasks.push_back({it, g * rows / row_groups, (g + 1) * rows / row_groups});
    }
  std::vector<float> partial_o, partial_ml;
  if (per_item) {
    partial_o.assign(items.size() * part_rows * D, 0.f);
    partial_ml.assign(items.size() * part_rows * 2, 0.f);
  }
  auto out_row = [&](const Unit& u, int nt, int r) {
    const int h = r / (nt * G), i = u.q_begin + (r / G) % nt, g = r % G;
    return p.out + (int64_t(p.qstart[u.seq] + i) * H + h * G + g) * D;
  };
  // the sink's term of the softmax denominator (relative to the row's running max mx), 0 without sinks
  auto sink_term = [&](int nt, int r, float mx) {
    return p.sinks ? std::exp(p.sinks[r / (nt * G) * G + r % G] - mx) : 0.f;
  };
  // a unit's rows from its `count` partials (ml: [count][part_rows][2], o: [count][part_rows][D])
  auto merge = [&](const Unit& u, int count, const float* ml, const float* po, float* acc) {
    const int nt = u.tokens();
    for (int r = 0; r < nt * H; ++r) {
      float mx = NEG_INF;
      for (int s = 0; s < count; ++s) mx = std::max(mx, ml[(s * part_rows + r) * 2]);
      std::fill(acc, acc + D, 0.f);
      float sum = 0.f;
      for (int s = 0; s < count; ++s) {
        const size_t base = size_t(s) * part_rows + r;
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

  const int64_t num_tasks = per_item ? int64_t(tasks.size()) : num_units;
  // Units taken one by one as threads come free, heaviest (rows x keys) first: split in contiguous
  // shares, a lone fresh prompt's later tiles (which see more keys) had fallen to one thread,
  // up to three times the other's work.
  std::vector<int> heaviest_first;
  std::atomic<int64_t> next_unit{0};
  if (!per_item) {
    heaviest_first.resize(num_units);
    std::iota(heaviest_first.begin(), heaviest_first.end(), 0);
    auto work = [&](int ui) { return int64_t(units[ui].tokens()) * (units[ui].key_hi - units[ui].key_lo); };
    std::stable_sort(heaviest_first.begin(), heaviest_first.end(), [&](int a, int b) { return work(a) > work(b); });
  }
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(max_rows * D), m(max_rows), l(max_rows), acc(D);
    std::vector<float> unit_o, unit_ml;  // a unit's partials, when its task merges them
    typename V::Scratch scratch(p, max_rows);
    // the span's rows' m, l, o over its keys of unit u
    auto attend = [&](const Unit& u, Span span) {
      std::fill(o.begin() + span.r_lo * D, o.begin() + span.r_hi * D, 0.f);
      std::fill(m.begin() + span.r_lo, m.begin() + span.r_hi, NEG_INF);
      std::fill(l.begin() + span.r_lo, l.begin() + span.r_hi, 0.f);
      V::attend(scratch, p, u, span, Rows{m.data(), l.data(), o.data()});
    };
    // a partial's rows [r0, r1) (unnormalised output, running max and sum) into ml/po at slot s
    auto keep = [&](int r0, int r1, float* ml, float* po, int s) {
      std::copy(o.begin() + r0 * D, o.begin() + r1 * D, po + (size_t(s) * part_rows + r0) * D);
      for (int r = r0; r < r1; ++r) {
        ml[(size_t(s) * part_rows + r) * 2] = m[r];
        ml[(size_t(s) * part_rows + r) * 2 + 1] = l[r];
      }
    };
    if (per_item) {  // this thread's tasks are in order: a row group's next partition is often the next task
      for (int64_t task = begin; task < end; ++task) {
        const Task& t = tasks[task];
        const Item& it = items[t.item];
        auto same = [&](int64_t other) {  // the same unit's and rows' work
          return other >= begin && other < end && items[tasks[other].item].unit == it.unit &&
                 tasks[other].r_lo == t.r_lo;
        };
        const int fetch_hi = same(task + 1) ? items[tasks[task + 1].item].key_hi : it.key_hi;
        attend(units[it.unit], {it.key_lo, it.key_hi, fetch_hi, same(task - 1), t.r_lo, t.r_hi});
        keep(t.r_lo, t.r_hi, partial_ml.data(), partial_o.data(), t.item);
      }
      return;
    }
    // one unit at a time, the next one the heaviest left, whichever thread is free (each unit's
    // result is its own: which thread runs it changes nothing)
    for (int64_t next; (next = next_unit.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
      const int64_t task = heaviest_first[next];
      const Unit& u = units[task];
      const int nt = u.tokens(), rows = nt * H, count = first_item[task + 1] - first_item[task];
      if (merged) {
        unit_o.resize(size_t(count) * part_rows * D);
        unit_ml.resize(size_t(count) * part_rows * 2);
        for (int s = 0; s < count; ++s) {
          const Item& it = items[first_item[task] + s];
          attend(u, {it.key_lo, it.key_hi, u.key_hi, s > 0, 0, rows});  // the partitions in order: each fetches the next
          keep(0, rows, unit_ml.data(), unit_o.data(), s);
        }
        merge(u, count, unit_ml.data(), unit_o.data(), acc.data());
        continue;
      }
      const Item& whole = items[first_item[task]];
      attend(u, {whole.key_lo, whole.key_hi, whole.key_hi, false, 0, rows});
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
      merge(units[ui], first_item[ui + 1] - first_item[ui], partial_ml.data() + first * part_rows * 2,
            partial_o.data() + first * part_rows * D, acc.data());
    }
  });
}

// The next chunks' keys and values, fetched into L2 ahead of their use: blocks are scattered, so
// the hardware prefetcher cannot know where the next one is. The lines are issued a few at a time
// between pieces of the current chunk's work, each head's share in four pieces: issued as one
// burst per chunk, two chunks ahead, they stalled the core (16 decodes at 8k of context, bfloat16,
// on a Zen 5: 8.7-9.3 GB/s read that way, 21-24 GB/s spread four chunks ahead).
struct Ahead {
  const char* p = nullptr;
  int64_t left = 0;    // bytes not yet issued
  int64_t run = 0;     // > 0: runs of this many bytes (whole lines), one every `stride`; 0: one run
  int64_t stride = 0;
  int64_t at = 0;      // issued of the present run
  inline void issue(int64_t bytes) {
    for (; bytes > 0 && left > 0; bytes -= 64, left -= 64) {
      __builtin_prefetch(p + at, 0, 2);
      at += 64;
      if (at == run) p += stride, at = 0;
    }
  }
};

// The lines of n consecutive slots' kv heads [h_lo, h_hi) of a cache from slot row `first` (every
// head: one run; fewer: a run a slot)
template <typename C>
inline Ahead head_lines(const C* first, int n, int64_t slot_stride, int h_lo, int h_hi, int D) {
  const char* at = reinterpret_cast<const char*>(first + int64_t(h_lo) * D);
  const int64_t bytes = int64_t(h_hi - h_lo) * D * int64_t(sizeof(C));
  if (bytes == slot_stride * int64_t(sizeof(C))) return {at, n * bytes};
  const int64_t run = (bytes + 63) / 64 * 64;
  return {at, n * run, run, slot_stride * int64_t(sizeof(C))};
}

// f(r, pos, q) for each row r in [r_lo, r_hi) of unit u (kv head major, then query token, then
// head of the group): its query token's position and its query's D values
template <typename T, typename C, class F>
void for_unit_rows(const Problem<T, C>& p, const Unit& u, int r_lo, int r_hi, F&& f) {
  const int nt = u.tokens(), group_rows = nt * p.G, first_pos = p.first_pos(u.seq);
  for (int r = r_lo; r < r_hi; ++r) {
    const int h = r / group_rows, i = u.q_begin + (r / p.G) % nt, g = r % p.G;
    f(r, first_pos + i, p.q + (int64_t(p.qstart[u.seq] + i) * p.H + h * p.G + g) * p.D);
  }
}

// A sequence's keys from `key` on, in chunks of up to KW that never cross a block, walked block by
// block from one division: a division per chunk (its slot and its size by the block size, a
// runtime value) cost more than a decode chunk's softmax (fp8's decode: 42 against 28 cycles a key
// and kv head with the keys in L2)
struct ChunkWalk {
  const int* table;
  int BS, hi, key, blk, off;  // the next chunk starts at key: block blk of the table, offset off in it
  ChunkWalk(const int* table, int BS, int lo, int hi) : table(table), BS(BS), hi(hi), key(lo) {
    blk = lo / BS, off = lo - blk * BS;
  }
  bool done() const { return key >= hi; }
  int size() const { return std::min({KW, hi - key, BS - off}); }
  int64_t slot() const { return int64_t(table[blk]) * BS + off; }
  void next() {
    const int n = size();
    key += n, off += n;
    if (off == BS) off = 0, ++blk;
  }
};

// a kv head's keys [key0, key0 + n) of one chunk (n <= KW, within a block), k and v at its first
// slot (a key's row every slot_stride)
template <typename C>
struct Chunk {
  const C *k, *v;
  int n, key0;
};

// The vector variants' attend: the unit's keys in chunks of up to KW that never cross a block,
// each chunk's kv heads in turn, the chunks PREFETCH_CHUNKS ahead fetched in pieces in between.
// A decode's few rows a head take their scores from the keys as they lie where the variant can
// (V::SCORES_FROM_KEYS): staging the keys would cost more than folding each row's sums.
// Batch-invariant calls always stage, so a row's sums are the same whichever tile it is in.
// V gives the steps:
//   V::load_query(s, p, r, q)                 row r of the unit (q: its D values)
//   V::stage_keys(s, p, k, n)                 a kv head's n keys of the chunk, staged for the scores
//   V::step(s, p, chunk, r0, count, staged, rows)  the online softmax of rows [r0, r0 + count)
//   V::finish(s, p, num_rows, o)              the rows' outputs back in dim order
template <class V, typename T, typename C>
void attend_in_chunks(typename V::Scratch& s, const Problem<T, C>& p, const Unit& u, const Span& span, Rows rows) {
  const int G = p.G, D = p.D, BS = p.BS;
  const int nt = u.tokens(), group_rows = nt * G;
  const int h_lo = span.r_lo / group_rows, h_hi = (span.r_hi + group_rows - 1) / group_rows;  // the rows' kv heads
  const bool row_scores = p.partition == 0 && group_rows * 10 <= D;
  const bool staged = !(V::SCORES_FROM_KEYS && row_scores);
  for_unit_rows(p, u, span.r_lo, span.r_hi, [&](int r, int pos, const T* q) {
    s.qpos[r] = pos;
    V::load_query(s, p, r, q);
  });
  const int* table = p.tables + int64_t(u.seq) * p.max_blocks;
  ChunkWalk walk(table, BS, span.lo, span.hi), ahead(table, BS, span.lo, span.hi);  // ahead: PREFETCH_CHUNKS on
  for (int i = 0; i < PREFETCH_CHUNKS && !ahead.done(); ++i) ahead.next();
  for (; !walk.done(); walk.next()) {
    const int key0 = walk.key, n = walk.size();
    const int64_t slot = walk.slot();
    Ahead ak, av;
    int64_t piece = 0;  // half a kv head's share of the lines (no division by the heads)
    if (!ahead.done()) {
      piece = (ahead.size() * int64_t(D) * int64_t(sizeof(C)) / 2 + 63) / 64 * 64;
      ak = head_lines(p.k + ahead.slot() * p.slot_stride, ahead.size(), p.slot_stride, h_lo, h_hi, D);
      av = head_lines(p.v + ahead.slot() * p.slot_stride, ahead.size(), p.slot_stride, h_lo, h_hi, D);
      ahead.next();
    }
    for (int h = h_lo; h < h_hi; ++h) {
      ak.issue(piece);
      const Chunk<C> chunk{p.k + slot * p.slot_stride + int64_t(h) * D, p.v + slot * p.slot_stride + int64_t(h) * D,
                           n, key0};
      if (staged) V::stage_keys(s, p, chunk.k, n);
      ak.issue(h + 1 < h_hi ? piece : ak.left);
      av.issue(piece);
      const int r0 = std::max(span.r_lo, h * group_rows), r1 = std::min(span.r_hi, (h + 1) * group_rows);
      V::step(s, p, chunk, r0, r1 - r0, staged, rows);
      av.issue(h + 1 < h_hi ? piece : av.left);
    }
  }
  V::finish(s, p, span.r_hi - span.r_lo, rows.o + int64_t(span.r_lo) * D);
}

// What a vector variant V shares: its units' shape, its keys' start, and attend_in_chunks
template <class V, typename T, typename C = T>
struct Chunked {
  static constexpr bool ROW_RANGES = true;  // attend_in_chunks takes the span's rows only
  static int unit_tokens(int G) { return std::max(1, 36 / G); }  // about 36 rows per kv head
  static int first_key(int lo, const Problem<T, C>&) { return lo; }
  template <class Scratch>
  static void attend(Scratch& s, const Problem<T, C>& p, const Unit& u, const Span& span, Rows rows) {
    attend_in_chunks<V>(s, p, u, span, rows);
  }
};

// the buffers every vector variant's scratch has
struct ChunkedScratch {
  std::vector<int> qpos;  // each row's query position
  explicit ChunkedScratch(int max_rows) : qpos(max_rows) {}
};

}  // namespace atom::attention
