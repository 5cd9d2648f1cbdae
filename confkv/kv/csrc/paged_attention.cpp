// Fused decode attention over the block-paged KV pool, on CPU. The semantics (layouts, key order with
// KEY_ONLY entries first, GQA, outputs) are those of decode_attention_reference in
// confkv/kv/paged_attention.py. Work items are spans of kSpan entries of a (row, KV head) pair: each
// reads its entries in place at their storage format, scores all query heads of the group against each
// key vector loaded (and decoded) once, and keeps an online softmax over tiles of entries; the spans of
// a pair are then merged. A row's keys and FULL values may lie in different pools (int4c keys hold no
// values): values in the keys' format are compiled with them, other pairings dispatched per tile.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "formats.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// The build stays portable (no -march): the hot path is compiled per ISA level and picked at load time.
#define CONFKV_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CONFKV_MULTIVERSION
#endif
// Forced inlining puts the templated loops inside each ISA clone of the caller.
#define CONFKV_INLINE inline __attribute__((always_inline))

namespace {

// As a template argument: the pool's format, dispatched per tile instead of compiled in.
constexpr int64_t kAnyFormat = -1;

constexpr int64_t kTile = 64;  // entries scored per online-softmax step
// Entries per work item. Splitting long sequences keeps every thread busy when a batch has few rows; the
// split depends on the sequence alone, so a row's result does not depend on the batch or the thread count.
constexpr int64_t kSpan = 256;
constexpr int64_t kUnroll = 4;  // key (value) vectors processed together (the loops name four), for independent sums

CONFKV_INLINE float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

CONFKV_INLINE uint32_t to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// fp16 -> fp32 with integer ops and masks only (no branches), so that loops over it vectorise at any
// ISA level.
CONFKV_INLINE float half_to_float(uint16_t h) {
  const uint32_t em = h & 0x7fffu;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t inf_nan = 0u - static_cast<uint32_t>(em >= 0x7c00u);
  const uint32_t subnormal = 0u - static_cast<uint32_t>(em < 0x400u);
  // Rebias the exponent (15 -> 127); an all-ones exponent (inf, nan) must stay all ones.
  const uint32_t normal_bits = (em << 13) + (112u << 23) + (inf_nan & (112u << 23));
  const uint32_t subnormal_bits = to_bits(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  return from_bits((subnormal_bits & subnormal) | (normal_bits & ~subnormal) | sign);
}

// exp(x) for x <= 0 (scores minus their running max): Cephes' expf polynomial, which vectorises where
// std::exp does not (glibc's vector exp needs -ffast-math). Relative error below 1e-7.
CONFKV_INLINE float exp_nonpositive(float x) {
  // Below -87 the result underflows: clamp, then zero it. Compared as integers (for x <= 0 the bit
  // patterns order like the magnitudes) because float compares block vectorisation under trapping math.
  const uint32_t limit = 0xc2ae0000u;  // -87.0f
  const uint32_t underflow = 0u - static_cast<uint32_t>(to_bits(x) > limit);
  const float xc = from_bits((to_bits(x) & ~underflow) | (limit & underflow));
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer kept in the low mantissa bits
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  const int32_t ni = static_cast<int32_t>(to_bits(t) - to_bits(magic));
  const float r = xc - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return from_bits(to_bits(y * from_bits(static_cast<uint32_t>(ni + 127) << 23)) & ~underflow);
}

// A pool's head vectors are rows of `row_bytes`: the codes, then (quantised formats) the params as fp16
// bits: per vector, its scale (and minimum at 4 and 2 bits); for int4c, the block's params for the KV head
// (the scales of the channels, then their minimums) spread in order over the tails of its block_size rows.
struct Pool {
  const uint8_t* data = nullptr;
  int64_t format = kFloat32;
  int64_t num_blocks = 0;
  int64_t kv_heads = 0;
  int64_t row_bytes = 0;
};

// Bytes of one entry's vector in format F.
template <int64_t F>
constexpr int64_t entry_bytes(int64_t dim) {
  if constexpr (F == kFloat32) return dim * 4;
  if constexpr (F == kFloat16 || F == kBFloat16) return dim * 2;
  if constexpr (F == kInt8) return dim;
  if constexpr (F == kInt4 || F == kInt4c) return dim / 2;
  return dim / 4;
}

// The params of a quantised vector: the fp16 bits after its codes.
template <int64_t F>
CONFKV_INLINE const uint16_t* params_of(const uint8_t* row, int64_t dim) {
  return reinterpret_cast<const uint16_t*>(row + entry_bytes<F>(dim));
}

// The vector of entry `e` as float32: a pointer into the pool for float32, else decoded into `buf`. For int4c,
// `channels` holds its block's params for its head, decoded: the scales [dim], then the minimums [dim].
template <int64_t F>
CONFKV_INLINE const float* load(const uint8_t* row, int64_t dim, float* buf, const float* channels) {
  if constexpr (F == kFloat32) {
    return reinterpret_cast<const float*>(row);
  } else if constexpr (F == kFloat16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) buf[i] = half_to_float(src[i]);
  } else if constexpr (F == kBFloat16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) buf[i] = from_bits(static_cast<uint32_t>(src[i]) << 16);
  } else if constexpr (F == kInt8) {
    const int8_t* src = reinterpret_cast<const int8_t*>(row);
    const float scale = half_to_float(params_of<F>(row, dim)[0]);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) buf[i] = static_cast<float>(src[i]) * scale;
  } else if constexpr (F == kInt4) {
    // Low nibble of byte i is dimension i, high nibble dimension i + dim / 2.
    const int64_t half = dim / 2;
    const uint8_t* src = row;
    const uint16_t* params = params_of<F>(row, dim);
    const float scale = half_to_float(params[0]);
    const float minimum = half_to_float(params[1]);
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      buf[i] = static_cast<float>(src[i] & 0x0f) * scale + minimum;
      buf[i + half] = static_cast<float>(src[i] >> 4) * scale + minimum;
    }
  } else if constexpr (F == kInt4c) {
    // Packed as int4; the scale and minimum are the channel's.
    const int64_t half = dim / 2;
    const uint8_t* src = row;
    const float* scale = channels;
    const float* minimum = channels + dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      buf[i] = static_cast<float>(src[i] & 0x0f) * scale[i] + minimum[i];
      buf[i + half] = static_cast<float>(src[i] >> 4) * scale[i + half] + minimum[i + half];
    }
  } else {
    static_assert(F == kInt2, "no loader for this format");
    // Bits 2k..2k+1 of byte i are dimension i + k * dim / 4 (KEY_ONLY values only).
    const int64_t quarter = dim / 4;
    const uint8_t* src = row;
    const uint16_t* params = params_of<F>(row, dim);
    const float scale = half_to_float(params[0]);
    const float minimum = half_to_float(params[1]);
#pragma omp simd
    for (int64_t i = 0; i < quarter; ++i) {
      buf[i] = static_cast<float>(src[i] & 0x03) * scale + minimum;
      buf[i + quarter] = static_cast<float>((src[i] >> 2) & 0x03) * scale + minimum;
      buf[i + 2 * quarter] = static_cast<float>((src[i] >> 4) & 0x03) * scale + minimum;
      buf[i + 3 * quarter] = static_cast<float>(src[i] >> 6) * scale + minimum;
    }
  }
  return buf;
}

// Walks a table of `entries` entries in order from `start`, a pointer step per entry: the division, table
// lookup and products that find a row are done once per block. A cursor over int4c keys needs `channels`,
// room for 2 * dim floats: its current block's params, decoded (see load).
class Cursor {
 public:
  Cursor(const int32_t* table, int64_t block_size, int64_t start, int64_t entries, float* channels = nullptr)
      : table_(table),
        block_size_(block_size),
        last_block_((entries + block_size - 1) / block_size - 1),
        index_(start / block_size),
        offset_(start % block_size),
        channels_(channels) {}

  // The current entry's row in the pool, then a step to the next entry. For int4c, `channels()` then holds
  // the params of that entry's block.
  template <int64_t F>
  CONFKV_INLINE const uint8_t* next(const Pool& pool, int64_t kv_head, int64_t dim) {
    if (row_ == nullptr) enter<F>(pool, kv_head, dim);
    const uint8_t* row = row_;
    // Blocks are scattered, so the hardware prefetcher cannot follow from one block to the next:
    // request the entry one block ahead (its row holds its params, and for int4c its share of the block's).
    if (ahead_ != nullptr) {
      for (int64_t b = 0; b < pool.row_bytes; b += 64) __builtin_prefetch(ahead_ + b);
      ahead_ += stride_;
    }
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++index_;
      row_ = nullptr;
    } else {
      row_ += stride_;
    }
    return row;
  }

  // The current entry's vector as float32 (see load), then a step to the next entry.
  template <int64_t F>
  CONFKV_INLINE const float* take(const Pool& pool, int64_t kv_head, int64_t dim, float* buf) {
    return load<F>(next<F>(pool, kv_head, dim), dim, buf, channels_);
  }

  // For int4c: the table index of the block whose params `channels()` holds (it changes when a block begins).
  int64_t channels_block() const { return channels_index_; }
  const float* channels() const { return channels_; }

 private:
  // The row of KV head `kv_head` at offset 0 of `block`, in the pool's [num_blocks, block_size, kv_heads] rows.
  static const uint8_t* block_row(const Pool& pool, int32_t block, int64_t block_size, int64_t kv_head) {
    return pool.data + ((static_cast<int64_t>(block) * block_size) * pool.kv_heads + kv_head) * pool.row_bytes;
  }

  // Points at the current entry of block index_ (and the same offset of the next block).
  template <int64_t F>
  void enter(const Pool& pool, int64_t kv_head, int64_t dim) {
    stride_ = pool.kv_heads * pool.row_bytes;
    const uint8_t* start = block_row(pool, table_[index_], block_size_, kv_head);
    row_ = start + offset_ * stride_;
    ahead_ = index_ < last_block_ ? block_row(pool, table_[index_ + 1], block_size_, kv_head) + offset_ * stride_
                                  : nullptr;
    if constexpr (F == kInt4c) {
      // The params are the block's: decoded once per block, not per entry (twice as many values as its codes).
      // Each of the block's rows holds the next 2 * dim / block_size of them after its codes.
      const int64_t share = 2 * dim / block_size_;
      for (int64_t r = 0; r < block_size_; ++r) {
        const uint16_t* src = params_of<F>(start + r * stride_, dim);
#pragma omp simd
        for (int64_t i = 0; i < share; ++i) channels_[r * share + i] = half_to_float(src[i]);
      }
      channels_index_ = index_;
    }
  }

  const int32_t* table_;
  int64_t block_size_;
  int64_t last_block_;
  int64_t index_;
  int64_t offset_;
  float* channels_;
  int64_t channels_index_ = -1;  // the table index of the block whose params `channels_` holds
  const uint8_t* row_ = nullptr;  // the current entry's row, null until its block is entered
  const uint8_t* ahead_ = nullptr;  // the row one block ahead, to prefetch
  int64_t stride_ = 0;  // bytes from an entry's row to the next entry's (same KV head)
};

struct Args {
  const float* query;
  int64_t heads, kv_heads, group, dim;
  std::vector<Pool> pools;
  const int32_t* row_slot;
  const int32_t* row_pool;
  const int32_t* row_value_pool;
  int64_t key_only_pool;
  const int32_t* key_tables;
  const int32_t* value_tables;
  const int32_t* key_only_tables;
  int64_t key_stride, value_stride, key_only_stride;
  const int32_t* num_keys;
  const int32_t* num_key_only;
  int64_t block_size;
  float scale;
  int64_t window;  // a sliding-window layer's: a row attends to its last `window` entries (0: to all)
  bool vector = false;  // whether the vector path serves (see vector_path)
  const int32_t* observe_index;
  std::vector<int64_t> observed_row;  // per observed index: the row that fills it, or -1
  int64_t width;  // entries held by the longest observed row
  int64_t spans;  // spans per (row, KV head) pair: those of the longest row
  // Per span: online-softmax state [spans total, group] and unnormalised output [spans total, group, dim].
  float* span_max;
  float* span_sum;
  float* span_acc;
  float* raw;  // [num_observed, heads, width]: observed rows' scaled scores
  float* head_max;  // [rows, heads]: the final max and sum of exp, for the observed probabilities
  float* head_sum;
  float* out;
  float* lse;
  float* observed;
};

// The first entry a row holding n attends to: a sliding-window layer holds its entries in position
// order, so its window is its last `window` entries.
CONFKV_INLINE int64_t first_attended(const Args& a, int64_t n) {
  return a.window > 0 ? std::max<int64_t>(0, n - a.window) : 0;
}

// Per-thread buffers.
struct Scratch {
  std::vector<float> keys, values;  // kUnroll decoded vectors each
  std::vector<float> scores;  // [group, kTile]: scaled scores, then their exp
  std::vector<float> channels;  // [2, dim]: the params of the int4c key block being read, decoded
  // The vector path's (see attend_vector).
  std::vector<float> partial;  // [group, 8, 8]: per query head, 8 keys' unreduced dot products
  std::vector<float> weights;  // [group, kTile]: each value row's probability times its scale
  std::vector<const uint8_t*> rows;  // [kTile]: the value rows of a tile
  std::vector<float> query_sum;  // [group]: each query head's sum, what a key's minimum adds per unit
  std::vector<float> query_codes;  // [group, dim]: the query as it multiplies int4c codes (times the channel scales)
  std::vector<float> query_shift;  // [group]: and what the block's channel minimums add to its scores
  int64_t query_block = -1;  // the key block `query_codes` was made for

  explicit Scratch(const Args& a)
      : keys(kUnroll * a.dim),
        values(kUnroll * a.dim),
        scores(a.group * kTile),
        channels(2 * a.dim),
        partial(a.group * 64),
        weights(a.group * kTile),
        rows(kTile),
        query_sum(a.group),
        query_codes(a.group * a.dim),
        query_shift(a.group) {}
};

// Scaled scores of the next `count` keys against every query head of the group, into s.scores.
template <int64_t F>
CONFKV_INLINE void score_tile(const Args& a, const Pool& pool, Cursor& keys, int64_t kv_head, const float* q,
                              int64_t count, Scratch& s) {
  const int64_t dim = a.dim;
  float* scores = s.scores.data();
  int64_t t = 0;
  for (; t + kUnroll <= count; t += kUnroll) {
    const float* k[kUnroll];
    for (int64_t u = 0; u < kUnroll; ++u) k[u] = keys.take<F>(pool, kv_head, dim, s.keys.data() + u * dim);
    const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
    for (int64_t g = 0; g < a.group; ++g) {
      const float* qg = q + g * dim;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t i = 0; i < dim; ++i) {
        a0 += qg[i] * k0[i];
        a1 += qg[i] * k1[i];
        a2 += qg[i] * k2[i];
        a3 += qg[i] * k3[i];
      }
      float* sg = scores + g * kTile + t;
      sg[0] = a0 * a.scale;
      sg[1] = a1 * a.scale;
      sg[2] = a2 * a.scale;
      sg[3] = a3 * a.scale;
    }
  }
  for (; t < count; ++t) {
    const float* k0 = keys.take<F>(pool, kv_head, dim, s.keys.data());
    for (int64_t g = 0; g < a.group; ++g) {
      const float* qg = q + g * dim;
      float a0 = 0.f;
#pragma omp simd reduction(+ : a0)
      for (int64_t i = 0; i < dim; ++i) a0 += qg[i] * k0[i];
      scores[g * kTile + t] = a0 * a.scale;
    }
  }
}

// score_tile in the format of `pool`, dispatched once per call (a tile). int2 holds no keys: the entry point
// rejects it as a key pool.
CONFKV_INLINE void score_any(const Args& a, const Pool& pool, Cursor& keys, int64_t kv_head, const float* q,
                             int64_t count, Scratch& s) {
  switch (pool.format) {
    case kFloat32:
      return score_tile<kFloat32>(a, pool, keys, kv_head, q, count, s);
    case kFloat16:
      return score_tile<kFloat16>(a, pool, keys, kv_head, q, count, s);
    case kBFloat16:
      return score_tile<kBFloat16>(a, pool, keys, kv_head, q, count, s);
    case kInt8:
      return score_tile<kInt8>(a, pool, keys, kv_head, q, count, s);
    case kInt4:
      return score_tile<kInt4>(a, pool, keys, kv_head, q, count, s);
    default:
      return score_tile<kInt4c>(a, pool, keys, kv_head, q, count, s);
  }
}

// acc[g] += p[g, t] * value_t for tile positions t in [begin, end), values read through `values`.
template <int64_t F>
CONFKV_INLINE void accumulate_values(const Args& a, const Pool& pool, Cursor& values, int64_t kv_head, int64_t begin,
                                     int64_t end, float* acc, Scratch& s) {
  const int64_t dim = a.dim;
  const float* probs = s.scores.data();
  int64_t t = begin;
  for (; t + kUnroll <= end; t += kUnroll) {
    const float* v[kUnroll];
    for (int64_t u = 0; u < kUnroll; ++u) v[u] = values.take<F>(pool, kv_head, dim, s.values.data() + u * dim);
    const float *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];
    for (int64_t g = 0; g < a.group; ++g) {
      const float* pg = probs + g * kTile + t;
      const float p0 = pg[0], p1 = pg[1], p2 = pg[2], p3 = pg[3];
      float* acc_g = acc + g * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) acc_g[i] += p0 * v0[i] + p1 * v1[i] + p2 * v2[i] + p3 * v3[i];
    }
  }
  for (; t < end; ++t) {
    const float* v0 = values.take<F>(pool, kv_head, dim, s.values.data());
    for (int64_t g = 0; g < a.group; ++g) {
      const float p0 = probs[g * kTile + t];
      float* acc_g = acc + g * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) acc_g[i] += p0 * v0[i];
    }
  }
}

// accumulate_values in the format of `pool`, dispatched once per call (a tile). int4c holds no values: the
// entry point rejects it as a value pool.
CONFKV_INLINE void accumulate_any(const Args& a, const Pool& pool, Cursor& values, int64_t kv_head, int64_t begin,
                                  int64_t end, float* acc, Scratch& s) {
  switch (pool.format) {
    case kFloat32:
      return accumulate_values<kFloat32>(a, pool, values, kv_head, begin, end, acc, s);
    case kFloat16:
      return accumulate_values<kFloat16>(a, pool, values, kv_head, begin, end, acc, s);
    case kBFloat16:
      return accumulate_values<kBFloat16>(a, pool, values, kv_head, begin, end, acc, s);
    case kInt8:
      return accumulate_values<kInt8>(a, pool, values, kv_head, begin, end, acc, s);
    case kInt4:
      return accumulate_values<kInt4>(a, pool, values, kv_head, begin, end, acc, s);
    default:
      return accumulate_values<kInt2>(a, pool, values, kv_head, begin, end, acc, s);
  }
}

// Entries [begin, end) of a (row, KV head) pair, into the span's max, sum and acc: the tiles' walk and online
// softmax every path shares. `score(pool, keys, q, count)` writes the next `count` keys' scaled scores into
// s.scores; `accumulate(pool, values, begin, end)` adds tile positions [begin, end) of values read through
// `values`, weighted by s.scores (then probabilities), to acc.
template <class Score, class Accumulate>
CONFKV_INLINE void attend_with(const Args& a, int64_t row, int64_t kv_head, int64_t begin, int64_t end, float* max,
                               float* sum, float* acc, Scratch& s, Score score, Accumulate accumulate) {
  const int64_t slot = a.row_slot[row];
  const int64_t n = a.num_keys[slot];
  const int64_t n_key_only = a.num_key_only[slot];
  const Pool& pool = a.pools[a.row_pool[row]];
  const Pool& value_pool = a.pools[a.row_value_pool[row]];
  const int64_t dim = a.dim;
  const float* q = a.query + (row * a.heads + kv_head * a.group) * dim;
  const int64_t observe = a.observe_index[row];
  std::fill(max, max + a.group, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + a.group, 0.f);
  std::fill(acc, acc + a.group * dim, 0.f);
  Cursor keys(a.key_tables + slot * a.key_stride, a.block_size, begin, n, s.channels.data());
  Cursor key_only_values(a.key_only_tables + slot * a.key_only_stride, a.block_size, std::min(begin, n_key_only),
                         n_key_only);
  Cursor full_values(a.value_tables + slot * a.value_stride, a.block_size, std::max(begin - n_key_only, int64_t{0}),
                     n - n_key_only);
  for (int64_t j0 = begin; j0 < end; j0 += kTile) {
    const int64_t count = std::min(kTile, end - j0);
    score(pool, keys, q, count);
    for (int64_t g = 0; g < a.group; ++g) {
      float* sg = s.scores.data() + g * kTile;
      if (observe >= 0) {
        std::copy(sg, sg + count, a.raw + (observe * a.heads + kv_head * a.group + g) * a.width + j0);
      }
      float tile_max = -std::numeric_limits<float>::infinity();
      // A plain compare-select: std::max does not vectorise here.
#pragma omp simd reduction(max : tile_max)
      for (int64_t t = 0; t < count; ++t) tile_max = sg[t] > tile_max ? sg[t] : tile_max;
      const float new_max = std::max(max[g], tile_max);
      float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
      for (int64_t t = 0; t < count; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        tile_sum += sg[t];
      }
      if (new_max > max[g]) {
        // Rescale what was accumulated under the previous max (nothing on the first tile).
        const float alpha = std::exp(max[g] - new_max);
        sum[g] *= alpha;
        float* acc_g = acc + g * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) acc_g[i] *= alpha;
        max[g] = new_max;
      }
      sum[g] += tile_sum;
    }
    // KEY_ONLY entries come first in key order; their values live in the key-only pool.
    const int64_t key_only_end = std::clamp(n_key_only - j0, int64_t{0}, count);
    if (key_only_end > 0) accumulate(a.pools[a.key_only_pool], key_only_values, 0, key_only_end);
    if (key_only_end < count) accumulate(value_pool, full_values, key_only_end, count);
  }
}

// attend_with on the portable loops (vectorised by the compiler): F is the format of the row's keys and FULL
// values, or kAnyFormat (those of their pools, which may differ).
template <int64_t F>
CONFKV_INLINE void attend(const Args& a, int64_t row, int64_t kv_head, int64_t begin, int64_t end, float* max,
                          float* sum, float* acc, Scratch& s) {
  attend_with(
      a, row, kv_head, begin, end, max, sum, acc, s,
      [&](const Pool& pool, Cursor& keys, const float* q, int64_t count) {
        if constexpr (F == kAnyFormat) {
          score_any(a, pool, keys, kv_head, q, count, s);
        } else {
          score_tile<F>(a, pool, keys, kv_head, q, count, s);
        }
      },
      [&](const Pool& pool, Cursor& values, int64_t first, int64_t last) {
        // KEY_ONLY values (another pool, another format) are dispatched per tile.
        if constexpr (F == kAnyFormat) {
          accumulate_any(a, pool, values, kv_head, first, last, acc, s);
        } else {
          if (pool.format == F) {
            accumulate_values<F>(a, pool, values, kv_head, first, last, acc, s);
          } else {
            accumulate_any(a, pool, values, kv_head, first, last, acc, s);
          }
        }
      });
}

#if defined(__GNUC__) && defined(__x86_64__)
#define CONFKV_VECTOR_PATH 1
// The vector path: the same walk (attend_with) with the dot products written for AVX2, FMA and F16C (the
// x86-64-v3 level), on the codes as stored. A key's scores are its codes times the query, times its scale
// once (plus its minimum times the query's sum); a value's weight is its probability times its scale
// (plus its minimum times the probability, added to every dimension once per tile). Per key, each query
// head of the group sums into one register, and 8 keys' sums are reduced together; per value, the
// group's accumulators stay in registers over a tile, a few dimensions at a time.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Dimensions 8c..8c+7 of a row's codes as float: the codes' values, before the row's scale and minimum.
template <int64_t F>
CONFKV_INLINE __m256 codes8(const uint8_t* row, int64_t c, int64_t dim) {
  const int64_t i = 8 * c;
  if constexpr (F == kFloat32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (F == kFloat16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  } else if constexpr (F == kBFloat16) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  } else if constexpr (F == kInt8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i))));
  } else if constexpr (F == kInt4 || F == kInt4c) {
    // Low nibble of byte i is dimension i, high nibble dimension i + dim / 2.
    const int64_t half = dim / 2;
    const int64_t byte = i < half ? i : i - half;
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + byte)));
    const __m256i nibble = i < half ? _mm256_and_si256(wide, _mm256_set1_epi32(0x0f)) : _mm256_srli_epi32(wide, 4);
    return _mm256_cvtepi32_ps(nibble);
  } else {
    static_assert(F == kInt2, "no codes for this format");
    // Bits 2k..2k+1 of byte i are dimension i + k * dim / 4.
    const int64_t quarter = dim / 4;
    const int64_t k = i / quarter;
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i - k * quarter)));
    const __m256i bits = _mm256_srl_epi32(wide, _mm_cvtsi64_si128(2 * k));
    return _mm256_cvtepi32_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0x03)));
  }
}

// A row's scale and minimum: a vector is its codes times the scale plus the minimum (1 and 0 for floats;
// int4c's are per channel, see score_vector).
template <int64_t F>
CONFKV_INLINE void row_params(const uint8_t* row, int64_t dim, float& scale, float& minimum) {
  scale = 1.f;
  minimum = 0.f;
  if constexpr (F == kInt8) {
    scale = _cvtsh_ss(params_of<F>(row, dim)[0]);
  } else if constexpr (F == kInt4 || F == kInt2) {
    scale = _cvtsh_ss(params_of<F>(row, dim)[0]);
    minimum = _cvtsh_ss(params_of<F>(row, dim)[1]);
  }
}

template <int64_t F>
constexpr bool has_minimum() {
  return F == kInt4 || F == kInt2 || F == kInt4c;
}

// The horizontal sums of v[0..7], as one vector.
CONFKV_INLINE __m256 sums8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // Each lane of u0 holds v[0..3]'s sums over that lane's half of the dimensions; u1 v[4..7]'s.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scaled scores of the next `count` keys (format KF) against the G query heads q of the group, into
// s.scores (8 at a time: positions up to the next multiple of 8 are written too, kTile being one).
template <int64_t KF, int G>
CONFKV_INLINE void score_vector(const Args& a, const Pool& pool, Cursor& keys, int64_t kv_head, const float* q,
                                int64_t count, Scratch& s) {
  // Keys scored together: independent sums hide the FMA's latency, and each query load serves K keys. One
  // at a time for int4c, whose query (times the block's channel scales) changes at a block's start.
  constexpr int K = KF == kInt4c ? 1 : G <= 2 ? 4 : G <= 6 ? 2 : 1;
  const int64_t dim = a.dim, chunks = dim / 8;
  float* partial = s.partial.data();
  const float* query = q;  // as it multiplies the codes
  alignas(32) float row_scale[8];
  alignas(32) float row_shift[G][8];  // what a key adds to head g's score: its minimum times the query's sum
  for (int64_t t0 = 0; t0 < count; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, count - t0);
    for (int64_t u = 0; u < 8; u += K) {
      const uint8_t* rows[K];
      for (int k = 0; k < K; ++k) {
        // Past the tile's end, a key is scored again (its scale zeroes it below) rather than branched around.
        rows[k] = u + k < n ? keys.next<KF>(pool, kv_head, dim) : (k > 0 ? rows[0] : nullptr);
      }
      if (rows[0] == nullptr) {  // no key left: sums of nothing
        for (int k = 0; k < K; ++k) {
          for (int g = 0; g < G; ++g) _mm256_storeu_ps(partial + (g * 8 + u + k) * 8, _mm256_setzero_ps());
          row_scale[u + k] = 0.f;
          for (int g = 0; g < G; ++g) row_shift[g][u + k] = 0.f;
        }
        continue;
      }
      if constexpr (KF == kInt4c) {
        if (keys.channels_block() != s.query_block) {  // a new block: its channels' scales and minimums
          const float* scale = keys.channels();
          const float* minimum = scale + dim;
          for (int g = 0; g < G; ++g) {
            float shift = 0.f;
#pragma omp simd reduction(+ : shift)
            for (int64_t i = 0; i < dim; ++i) {
              s.query_codes[g * dim + i] = q[g * dim + i] * scale[i];
              shift += q[g * dim + i] * minimum[i];
            }
            s.query_shift[g] = shift;
          }
          s.query_block = keys.channels_block();
        }
        query = s.query_codes.data();
      }
      __m256 acc[K][G];
      for (int k = 0; k < K; ++k) {
        for (int g = 0; g < G; ++g) acc[k][g] = _mm256_setzero_ps();
      }
      for (int64_t c = 0; c < chunks; ++c) {
        __m256 codes[K];
        for (int k = 0; k < K; ++k) codes[k] = codes8<KF>(rows[k], c, dim);
        for (int g = 0; g < G; ++g) {
          const __m256 qg = _mm256_loadu_ps(query + g * dim + 8 * c);
          for (int k = 0; k < K; ++k) acc[k][g] = _mm256_fmadd_ps(qg, codes[k], acc[k][g]);
        }
      }
      for (int k = 0; k < K; ++k) {
        for (int g = 0; g < G; ++g) _mm256_storeu_ps(partial + (g * 8 + u + k) * 8, acc[k][g]);
        float scale, minimum;
        row_params<KF>(rows[k], dim, scale, minimum);
        const bool held = u + k < n;
        row_scale[u + k] = held ? scale * a.scale : 0.f;
        for (int g = 0; g < G; ++g) {
          const float shift = KF == kInt4c ? s.query_shift[g] : minimum * s.query_sum[g];
          row_shift[g][u + k] = held ? shift * a.scale : 0.f;
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      __m256 v[8];
      for (int u = 0; u < 8; ++u) v[u] = _mm256_loadu_ps(partial + (g * 8 + u) * 8);
      __m256 scores = _mm256_mul_ps(sums8(v), _mm256_load_ps(row_scale));
      if constexpr (has_minimum<KF>()) scores = _mm256_add_ps(scores, _mm256_load_ps(row_shift[g]));
      _mm256_storeu_ps(s.scores.data() + g * kTile + t0, scores);
    }
  }
}

// acc[g] += p[g, t] * value_t for tile positions t in [begin, end), values (format VF) read through `values`.
template <int64_t VF, int G>
CONFKV_INLINE void accumulate_vector(const Args& a, const Pool& pool, Cursor& values, int64_t kv_head, int64_t begin,
                                     int64_t end, float* acc, Scratch& s) {
  const int64_t dim = a.dim, chunks = dim / 8, n = end - begin;
  const uint8_t** rows = s.rows.data();
  float* weights = s.weights.data();
  float shift[G] = {};
  for (int64_t t = 0; t < n; ++t) {
    rows[t] = values.next<VF>(pool, kv_head, dim);
    float scale, minimum;
    row_params<VF>(rows[t], dim, scale, minimum);
    for (int g = 0; g < G; ++g) {
      const float p = s.scores[g * kTile + begin + t];
      weights[g * kTile + t] = p * scale;
      shift[g] += p * minimum;
    }
  }
  // Dimensions per pass (C chunks of 8): the group's accumulators, its weights and a chunk of codes fit in
  // the 16 registers, and enough independent sums hide the FMA's latency.
  constexpr int64_t C = G <= 3 ? 4 : G <= 5 ? 2 : 1;
  for (int64_t c0 = 0; c0 < chunks; c0 += C) {
    __m256 r[G][C];
    for (int g = 0; g < G; ++g) {
      for (int64_t c = 0; c < C; ++c) r[g][c] = _mm256_loadu_ps(acc + g * dim + 8 * (c0 + c));
    }
    for (int64_t t = 0; t < n; ++t) {
      __m256 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(weights + g * kTile + t);
      for (int64_t c = 0; c < C; ++c) {
        const __m256 v = codes8<VF>(rows[t], c0 + c, dim);
        for (int g = 0; g < G; ++g) r[g][c] = _mm256_fmadd_ps(w[g], v, r[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * dim + 8 * (c0 + c), r[g][c]);
    }
  }
  if constexpr (has_minimum<VF>()) {
    for (int g = 0; g < G; ++g) {
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) acc[g * dim + i] += shift[g];
    }
  }
}

template <int G>
void attend_vector(const Args& a, int64_t row, int64_t kv_head, int64_t begin, int64_t end, float* max, float* sum,
                   float* acc, Scratch& s) {
  const int64_t dim = a.dim;
  const float* q = a.query + (row * a.heads + kv_head * a.group) * dim;
  for (int g = 0; g < G; ++g) {
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < dim; ++i) total += q[g * dim + i];
    s.query_sum[g] = total;
  }
  s.query_block = -1;
  attend_with(
      a, row, kv_head, begin, end, max, sum, acc, s,
      [&](const Pool& pool, Cursor& keys, const float* query, int64_t count) {
        switch (pool.format) {
          case kFloat32:
            return score_vector<kFloat32, G>(a, pool, keys, kv_head, query, count, s);
          case kFloat16:
            return score_vector<kFloat16, G>(a, pool, keys, kv_head, query, count, s);
          case kBFloat16:
            return score_vector<kBFloat16, G>(a, pool, keys, kv_head, query, count, s);
          case kInt8:
            return score_vector<kInt8, G>(a, pool, keys, kv_head, query, count, s);
          case kInt4:
            return score_vector<kInt4, G>(a, pool, keys, kv_head, query, count, s);
          default:
            return score_vector<kInt4c, G>(a, pool, keys, kv_head, query, count, s);
        }
      },
      [&](const Pool& pool, Cursor& values, int64_t first, int64_t last) {
        switch (pool.format) {
          case kFloat32:
            return accumulate_vector<kFloat32, G>(a, pool, values, kv_head, first, last, acc, s);
          case kFloat16:
            return accumulate_vector<kFloat16, G>(a, pool, values, kv_head, first, last, acc, s);
          case kBFloat16:
            return accumulate_vector<kBFloat16, G>(a, pool, values, kv_head, first, last, acc, s);
          case kInt8:
            return accumulate_vector<kInt8, G>(a, pool, values, kv_head, first, last, acc, s);
          case kInt4:
            return accumulate_vector<kInt4, G>(a, pool, values, kv_head, first, last, acc, s);
          default:
            return accumulate_vector<kInt2, G>(a, pool, values, kv_head, first, last, acc, s);
        }
      });
}

constexpr int64_t kVectorGroups = 8;  // the largest query group compiled for (a register each)

void attend_span_vector(const Args& a, int64_t row, int64_t kv_head, int64_t begin, int64_t end, float* max,
                        float* sum, float* acc, Scratch& s) {
  switch (a.group) {
    case 1:
      return attend_vector<1>(a, row, kv_head, begin, end, max, sum, acc, s);
    case 2:
      return attend_vector<2>(a, row, kv_head, begin, end, max, sum, acc, s);
    case 3:
      return attend_vector<3>(a, row, kv_head, begin, end, max, sum, acc, s);
    case 4:
      return attend_vector<4>(a, row, kv_head, begin, end, max, sum, acc, s);
    case 5:
      return attend_vector<5>(a, row, kv_head, begin, end, max, sum, acc, s);
    case 6:
      return attend_vector<6>(a, row, kv_head, begin, end, max, sum, acc, s);
    case 7:
      return attend_vector<7>(a, row, kv_head, begin, end, max, sum, acc, s);
    default:
      return attend_vector<8>(a, row, kv_head, begin, end, max, sum, acc, s);
  }
}

#pragma GCC pop_options

// Whether the vector path serves this call: the CPU has AVX2, FMA and F16C, head_dim is a multiple of 32 (whole
// chunks of 8 dimensions at every format), the group fits its registers, and CONFKV_PORTABLE_KERNEL=1 does not
// ask for the portable loops (the tests hold both to the reference).
bool vector_path(const Args& a) {
  static const bool supported =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const char* portable = std::getenv("CONFKV_PORTABLE_KERNEL");
  return supported && a.dim % 32 == 0 && a.group <= kVectorGroups && !(portable && std::strcmp(portable, "1") == 0);
}
#endif

// Rows whose keys and FULL values differ in format (int4c keys, whose values are per token, always): one more
// copy of the loops, dispatched per tile, rather than one per pair. A function of its own, so that the usual
// pairings compile as they would without it.
CONFKV_MULTIVERSION void attend_span_mixed(const Args& a, int64_t row, int64_t kv_head, int64_t begin, int64_t end,
                                           float* max, float* sum, float* acc, Scratch& s) {
  attend<kAnyFormat>(a, row, kv_head, begin, end, max, sum, acc, s);
}

CONFKV_MULTIVERSION void attend_span(const Args& a, int64_t row, int64_t kv_head, int64_t begin, int64_t end,
                                     float* max, float* sum, float* acc, Scratch& s) {
#ifdef CONFKV_VECTOR_PATH
  if (a.vector) return attend_span_vector(a, row, kv_head, begin, end, max, sum, acc, s);
#endif
  const int64_t format = a.pools[a.row_pool[row]].format;
  // Values in the keys' format (the usual pairing) are compiled with them.
  if (a.pools[a.row_value_pool[row]].format != format) {
    return attend_span_mixed(a, row, kv_head, begin, end, max, sum, acc, s);
  }
  switch (format) {
    case kFloat32:
      return attend<kFloat32>(a, row, kv_head, begin, end, max, sum, acc, s);
    case kFloat16:
      return attend<kFloat16>(a, row, kv_head, begin, end, max, sum, acc, s);
    case kBFloat16:
      return attend<kBFloat16>(a, row, kv_head, begin, end, max, sum, acc, s);
    case kInt8:
      return attend<kInt8>(a, row, kv_head, begin, end, max, sum, acc, s);
    default:
      return attend<kInt4>(a, row, kv_head, begin, end, max, sum, acc, s);
  }
}

// Combines the spans of a (row, KV head) pair into its output and lse.
CONFKV_MULTIVERSION void merge_spans(const Args& a, int64_t row, int64_t kv_head) {
  const int64_t n = a.num_keys[a.row_slot[row]];
  const int64_t first = first_attended(a, n);
  const int64_t dim = a.dim;
  const int64_t head0 = row * a.heads + kv_head * a.group;
  const int64_t span0 = (row * a.kv_heads + kv_head) * a.spans;
  const int64_t used = (n + kSpan - 1) / kSpan;
  for (int64_t g = 0; g < a.group; ++g) {
    float* out = a.out + (head0 + g) * dim;
    std::fill(out, out + dim, 0.f);
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t c = first / kSpan; c < used; ++c) max = std::max(max, a.span_max[(span0 + c) * a.group + g]);
    float sum = 0.f;
    for (int64_t c = first / kSpan; c < used; ++c) {
      const int64_t i = (span0 + c) * a.group + g;
      const float weight = std::exp(a.span_max[i] - max);
      sum += a.span_sum[i] * weight;
      const float* acc = a.span_acc + i * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] += acc[d] * weight;
    }
    if (n > first) {
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] *= inv;
    }
    a.lse[head0 + g] = n > first ? max + std::log(sum) : -std::numeric_limits<float>::infinity();
    a.head_max[head0 + g] = max;
    a.head_sum[head0 + g] = sum;
  }
}

// The probability each entry received, mean over all heads, for one observed index.
CONFKV_MULTIVERSION void observe_probabilities(const Args& a, int64_t o) {
  float* dst = a.observed + o * a.width;
  std::fill(dst, dst + a.width, 0.f);
  const int64_t row = a.observed_row[o];
  if (row < 0) return;
  const int64_t n = a.num_keys[a.row_slot[row]];
  const int64_t first = first_attended(a, n);  // entries before it were not attended: zero
  for (int64_t h = 0; h < a.heads; ++h) {
    const float* raw = a.raw + (o * a.heads + h) * a.width;
    const float max = a.head_max[row * a.heads + h];
    const float inv = 1.f / a.head_sum[row * a.heads + h];
#pragma omp simd
    for (int64_t j = first; j < n; ++j) dst[j] += exp_nonpositive(raw[j] - max) * inv;
  }
  const auto heads = static_cast<float>(a.heads);
#pragma omp simd
  for (int64_t j = first; j < n; ++j) dst[j] /= heads;
}

const int32_t* int32_data(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous() && t.dim() == dims, name,
              " must be a contiguous int32 CPU tensor with ", dims, " dimension(s)");
  return t.data_ptr<int32_t>();
}

// Every block the row reads lies in its pool: a bad table must raise, not read out of bounds.
void check_table(const int32_t* table, int64_t stride, int64_t entries, int64_t block_size, const Pool& pool,
                 const char* name) {
  const int64_t blocks = (entries + block_size - 1) / block_size;
  TORCH_CHECK(blocks <= stride, name, " has ", stride, " blocks per slot, ", blocks, " needed");
  for (int64_t b = 0; b < blocks; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < pool.num_blocks, name, " names block ", table[b], " of a pool of ",
                pool.num_blocks);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_attention(
    const at::Tensor& query, const std::vector<at::Tensor>& pool_data, const std::vector<int64_t>& pool_formats, const at::Tensor& row_slot, const at::Tensor& row_pool,
    const at::Tensor& row_value_pool, int64_t key_only_pool, const at::Tensor& key_tables,
    const at::Tensor& value_tables, const at::Tensor& key_only_tables, const at::Tensor& num_keys,
    const at::Tensor& num_key_only, int64_t block_size, double scale, const at::Tensor& observe_index,
    int64_t num_observed, int64_t window) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.is_contiguous() &&
                  query.dim() == 3,
              "query must be a contiguous float32 CPU tensor [rows, heads, head_dim]");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  TORCH_CHECK(dim > 0 && dim % 2 == 0, "head_dim must be even, got ", dim);
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  TORCH_CHECK(pool_data.size() == pool_formats.size() && !pool_data.empty(),
              "pool_data and pool_formats must be non-empty and of the same length");

  Args a{};
  a.query = query.data_ptr<float>();
  a.heads = heads;
  a.dim = dim;
  a.kv_heads = pool_data[0].dim() == 4 ? pool_data[0].size(2) : 0;
  TORCH_CHECK(a.kv_heads > 0 && heads % a.kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (",
              a.kv_heads, ")");
  a.group = heads / a.kv_heads;
  for (size_t i = 0; i < pool_data.size(); ++i) {
    const at::Tensor& data = pool_data[i];
    const int64_t format = pool_formats[i];
    static const at::ScalarType dtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kByte, at::kByte, at::kByte,
                                            at::kByte};
    TORCH_CHECK(format >= kFloat32 && format <= kInt4c, "pool ", i, ": unknown format code ", format);
    TORCH_CHECK(format != kInt4c || (2 * dim) % block_size == 0, "pool ", i, ": int4c needs 2 * head_dim (",
                2 * dim, ") to be a multiple of block_size (", block_size, ")");
    const int64_t codes = format == kInt4 || format == kInt4c ? dim / 2 : format == kInt2 ? dim / 4 : dim;
    // fp16 params after the codes: a scale (int8), a scale and a minimum (int4, int2), a share of the
    // block's (int4c); in elements of the pool's dtype (bytes for the quantised formats).
    const int64_t params = format == kInt8                     ? 2
                           : format == kInt4 || format == kInt2 ? 4
                           : format == kInt4c                   ? 4 * dim / block_size
                                                                : 0;
    const int64_t row = codes + params;
    TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.scalar_type() == dtypes[format] &&
                    data.dim() == 4 && data.size(1) == block_size && data.size(2) == a.kv_heads &&
                    data.size(3) == row,
                "pool ", i, ": data must be a contiguous CPU tensor [num_blocks, ", block_size, ", ", a.kv_heads, ", ",
                row, "] of ", dtypes[format]);
    Pool pool;
    pool.data = static_cast<const uint8_t*>(data.data_ptr());
    pool.format = format;
    pool.num_blocks = data.size(0);
    pool.kv_heads = a.kv_heads;
    pool.row_bytes = row * data.element_size();
    a.pools.push_back(pool);
  }
  const auto num_pools = static_cast<int64_t>(a.pools.size());

  a.row_slot = int32_data(row_slot, "row_slot", 1);
  a.row_pool = int32_data(row_pool, "row_pool", 1);
  a.row_value_pool = int32_data(row_value_pool, "row_value_pool", 1);
  a.observe_index = int32_data(observe_index, "observe_index", 1);
  a.key_tables = int32_data(key_tables, "key_tables", 2);
  a.value_tables = int32_data(value_tables, "value_tables", 2);
  a.key_only_tables = int32_data(key_only_tables, "key_only_tables", 2);
  a.num_keys = int32_data(num_keys, "num_keys", 1);
  a.num_key_only = int32_data(num_key_only, "num_key_only", 1);
  const int64_t slots = num_keys.size(0);
  TORCH_CHECK(row_slot.size(0) == rows && row_pool.size(0) == rows && row_value_pool.size(0) == rows &&
                  observe_index.size(0) == rows,
              "row_slot, row_pool, row_value_pool and observe_index must have one entry per query row");
  TORCH_CHECK(num_key_only.size(0) == slots && key_tables.size(0) == slots && value_tables.size(0) == slots &&
                  key_only_tables.size(0) == slots,
              "num_keys, num_key_only and the tables must have one row per slot");
  a.key_stride = key_tables.size(1);
  a.value_stride = value_tables.size(1);
  a.key_only_stride = key_only_tables.size(1);
  a.key_only_pool = key_only_pool;
  a.block_size = block_size;
  a.scale = static_cast<float>(scale);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: every entry)");
  a.window = window;
  TORCH_CHECK(num_observed >= 0, "num_observed must be >= 0");
  if (key_only_pool >= 0 && key_only_pool < num_pools) {
    TORCH_CHECK(a.pools[key_only_pool].format != kInt4c, "key_only_pool ", key_only_pool,
                " is int4c, which holds keys only, not values");
  }

  a.width = 0;
  a.observed_row.assign(num_observed, -1);
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = a.row_slot[r];
    TORCH_CHECK(slot >= 0 && slot < slots, "row ", r, ": slot ", slot, " out of range");
    TORCH_CHECK(a.row_pool[r] >= 0 && a.row_pool[r] < num_pools, "row ", r, ": pool ", a.row_pool[r], " out of range");
    TORCH_CHECK(a.row_value_pool[r] >= 0 && a.row_value_pool[r] < num_pools, "row ", r, ": value pool ",
                a.row_value_pool[r], " out of range");
    const int64_t n = a.num_keys[slot], n_key_only = a.num_key_only[slot];
    TORCH_CHECK(n >= 0 && n_key_only >= 0 && n_key_only <= n, "slot ", slot, ": bad num_keys ", n,
                " / num_key_only ", n_key_only);
    const Pool& pool = a.pools[a.row_pool[r]];
    const Pool& value_pool = a.pools[a.row_value_pool[r]];
    TORCH_CHECK(pool.format != kInt2, "row ", r, ": int2 holds KEY_ONLY values only, not keys");
    TORCH_CHECK(value_pool.format != kInt4c, "row ", r, ": value pool ", a.row_value_pool[r],
                " is int4c, which holds keys only, not values");
    check_table(a.key_tables + slot * a.key_stride, a.key_stride, n, block_size, pool, "key_tables");
    check_table(a.value_tables + slot * a.value_stride, a.value_stride, n - n_key_only, block_size, value_pool,
                "value_tables");
    if (n_key_only > 0) {
      TORCH_CHECK(key_only_pool >= 0 && key_only_pool < num_pools, "key_only_pool ", key_only_pool, " out of range");
      check_table(a.key_only_tables + slot * a.key_only_stride, a.key_only_stride, n_key_only, block_size,
                  a.pools[key_only_pool], "key_only_tables");
    }
    longest = std::max(longest, n);
    const int64_t observe = a.observe_index[r];
    TORCH_CHECK(observe < num_observed, "row ", r, ": observe_index ", observe, " >= num_observed ", num_observed);
    if (observe >= 0) {
      // Rows write their observed scores unsynchronised: each index must have one row.
      TORCH_CHECK(a.observed_row[observe] < 0, "observe_index ", observe, " is used by more than one row");
      a.observed_row[observe] = r;
      a.width = std::max(a.width, n);
    }
  }

  const auto f32 = query.options();
  at::Tensor out = at::empty({rows, heads, dim}, f32);
  at::Tensor lse = at::empty({rows, heads}, f32);
  at::Tensor observed = at::empty({num_observed, a.width}, f32);
  a.spans = (longest + kSpan - 1) / kSpan;
  const int64_t pairs = rows * a.kv_heads;
  const int64_t items = pairs * a.spans;
  // Scratch, kept per calling thread: a fresh allocation of this size would page-fault on every call.
  // Every element read is written first in the call.
  thread_local std::vector<float> workspace;
  const int64_t span_floats = items * a.group * (dim + 2), head_floats = 2 * rows * heads;
  const int64_t raw_floats = num_observed * heads * a.width;
  workspace.resize(std::max<size_t>(workspace.size(), span_floats + head_floats + raw_floats));
  a.span_max = workspace.data();
  a.span_sum = a.span_max + items * a.group;
  a.span_acc = a.span_sum + items * a.group;
  a.head_max = a.span_max + span_floats;
  a.head_sum = a.head_max + rows * heads;
  a.raw = a.head_max + head_floats;
  a.out = out.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  a.observed = observed.data_ptr<float>();

#ifdef CONFKV_VECTOR_PATH
  a.vector = vector_path(a);
#endif
  const int threads = static_cast<int>(std::clamp<int64_t>(items, 1, at::get_num_threads()));
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(a);
    // Dynamic: rows differ in length, so items differ in cost (those past a row's end in none).
#pragma omp for schedule(dynamic, 1)
    for (int64_t order = 0; order < items; ++order) {
      // The KV heads of a span one after another: an entry's heads share cache lines.
      const int64_t row = order / (a.spans * a.kv_heads), span = order / a.kv_heads % a.spans;
      const int64_t kv_head = order % a.kv_heads;
      const int64_t item = (row * a.kv_heads + kv_head) * a.spans + span;
      const int64_t n = a.num_keys[a.row_slot[row]];
      const int64_t begin = std::max(span * kSpan, first_attended(a, n));
      const int64_t end = std::min(span * kSpan + kSpan, n);
      if (begin < end) {
        attend_span(a, row, kv_head, begin, end, a.span_max + item * a.group, a.span_sum + item * a.group,
                    a.span_acc + item * a.group * dim, scratch);
      }
    }
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < pairs; ++pair) merge_spans(a, pair / a.kv_heads, pair % a.kv_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t o = 0; o < num_observed; ++o) observe_probabilities(a, o);
  }
  return {out, lse, observed};
}

// block_write.cpp
void encode_rows(const at::Tensor& x, const at::Tensor& rows, at::Tensor& data, int64_t format);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "Decode attention over the block-paged KV pool; see confkv/kv/paged_attention.py",
        py::arg("query"), py::arg("pool_data"), py::arg("pool_formats"), py::arg("row_slot"),
        py::arg("row_pool"), py::arg("row_value_pool"), py::arg("key_only_pool"), py::arg("key_tables"),
        py::arg("value_tables"), py::arg("key_only_tables"), py::arg("num_keys"), py::arg("num_key_only"),
        py::arg("block_size"), py::arg("scale"), py::arg("observe_index"), py::arg("num_observed"),
        py::arg("window") = 0,
        // The pass holds no Python state: let the server's other threads run meanwhile.
        py::call_guard<py::gil_scoped_release>());
  m.def("encode_rows", &encode_rows,
        "Store vectors x [n, kv_heads, head_dim] at a pool's rows in a format; see confkv/kv/block_pool.py",
        py::arg("x"), py::arg("rows"), py::arg("data"), py::arg("format"), py::call_guard<py::gil_scoped_release>());
}
