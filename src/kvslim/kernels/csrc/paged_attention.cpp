// Decode attention over the paged KV cache, read in place through the block tables.
//
// One work item per (sequence, partition of PART key positions), all KV heads: each key and
// value row is read once for the whole group of query heads that share it (GQA). Per
// query head: the scores of the keys the sequence may see (positions before its length, inside
// its sliding window), their softmax per partition, the weighted sum of the values, then the
// partitions combined, in float32, every sum in one fixed order (keys in position order,
// partitions in position order, a dot product's lanes in one fixed tree): a sequence's output
// depends on its own query and cache only, not on the batch, the padding of the tables or the
// threads.
//
// A query may read a tree's path instead of a contiguous prefix (speculative verification of a
// tree of drafts): its keys are positions [0, base) and then the positions base + i of the set
// bits i of its ancestor mask, in order. Every sum still runs over the logical keys 0, 1, 2, ...
// in the same partitions, so a tree row computes exactly what a plain decode with the same
// context computes.
//
// Cache layout: [blocks, block_size, kv_heads, head_dim], float32, or int8 with a float16
// scale per (slot, kv head) ([blocks, block_size, kv_heads]): an element is int8 * scale, as
// attention/kv_cache.py dequantizes it. The value cache may be narrower than the key cache and a
// view of it (DeepSeek's latent cache, attention/latent_cache.py: one KV head whose key is the
// row [c_kv; k_rope] and whose value is its first kv_lora_rank entries, sharing its scales): the
// output then has the value's width.
//
// Demoted blocks (engine/kv_demotion.py): with `demoted_scales` given, a float32 cache's bytes
// also hold int8 blocks (its int8 view: block b is bytes [b n, (b + 1) n) for n elements a
// block, four in the bytes of one float32 block) with their float16 scales beside it; a table
// entry e below -1 names int8 block -2 - e. A row reads each block in the precision it is in.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
#include "vec_tree.h"
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvslim_paged_attention {

// n float16 values as float32, eight at a time where the host converts them in one instruction
// (F16C), not one element at a time.
inline void halves_to_floats(const c10::Half* src, float* out, int64_t n) {
  int64_t d = 0;
#if defined(__F16C__)
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + d))));
#endif
  for (; d < n; ++d) out[d] = (float)src[d];
}

// GCC's vector types, lowered to whatever vectors the host has.
using kvslim_vec::f32x16;
using kvslim_vec::f32x8;
using kvslim_vec::f32x4;
using kvslim_vec::f32x2;
using kvslim_vec::tree_sum;

struct Cache {
  const float* f32 = nullptr;         // float32 elements, or
  const int8_t* i8 = nullptr;         // int8 elements with
  const c10::Half* scales = nullptr;  // their scales, or
  const uint8_t* packed = nullptr;    // 4- or 2-bit codes, each element code * scale + min
  int64_t block_stride, slot_stride, head_stride;   // elements (bytes, packed) per block, ...
  int64_t scale_block, scale_slot;                   // scales per block, per slot
  int64_t kv_heads, head_dim;
  // Packed (attention/lowbit_cache.py): `bits` per code, in planes (codes()); params
  // [.., 2, head_dim / group] (scale, then min) per block and head (keys per channel: group 1,
  // no slot stride) or per slot and head (values per token in groups).
  int64_t bits = 0, group = 1, param_block = 0, param_slot = 0, param_head = 0;
  const Cache* demoted = nullptr;   // a float32 cache's int8 view (its demoted blocks)

  // Row `slot` of `block` for kv head `h` as float32: the cache's own row (float32), or `out`
  // [head_dim] holding it dequantized (int8; packed values, code * scale + min per group).
  // Packed keys are scored on their codes instead (fold_keys).
  const float* row(int64_t block, int64_t slot, int64_t h, float* out) const {
    const int64_t at = block * block_stride + slot * slot_stride + h * head_stride;
    if (f32 != nullptr) return f32 + at;
    if (packed != nullptr) {
      const c10::Half* p = params(block, slot, h);
      const int64_t groups = head_dim / group;
      float affine[8];                            // scale, then min, per group (at most 4)
      for (int64_t g = 0; g < 2 * groups; ++g) affine[g] = (float)p[g];
      codes(block, slot, h, out, affine, affine + groups);
      return out;
    }
    const float s = (float)scales[block * scale_block + slot * scale_slot + h];
    for (int64_t d = 0; d < head_dim; ++d) out[d] = (float)i8[at + d] * s;
    return out;
  }

  // A packed row's codes as floats in `out` [head_dim], each code * scale[g] + min[g] of its
  // group g where `scale` is given. The codes lie in planes (kernels/lowbit_codes.py): plane i
  // of n bytes holds elements [i * n, (i + 1) * n).
  __attribute__((always_inline)) void codes(int64_t block, int64_t slot, int64_t h, float* out,
                                            const float* scale = nullptr,
                                            const float* mins = nullptr) const {
    const uint8_t* src = packed + block * block_stride + slot * slot_stride + h * head_stride;
    if (bits == 4) return planes<4>(src, out, head_dim, group, scale, mins);
    planes<2>(src, out, head_dim, group, scale, mins);
  }

  // 16 codes at a time in GCC's vector types (one widening, shift, mask, convert and, for a
  // value, multiply-add each, on whatever the host's vectors are; a group holds whole runs of
  // 16): plain loops over a plane's runtime length compiled to 64-byte vectors that a 32-byte
  // plane never filled, twice int8's time.
  template <int BITS>
  __attribute__((always_inline)) static void planes(const uint8_t* src, float* out,
                                                    int64_t head_dim, int64_t group,
                                                    const float* scale, const float* mins) {
    typedef uint8_t u8x16 __attribute__((vector_size(16)));
    typedef int32_t i32x16 __attribute__((vector_size(64)));
    constexpr int per_byte = 8 / BITS;
    constexpr uint8_t mask = (1 << BITS) - 1;
    const int64_t n = head_dim / per_byte;
    int64_t i = 0;
    const bool runs = scale == nullptr || group % 16 == 0;
    for (; runs && i + 16 <= n; i += 16) {
      u8x16 bytes;
      std::memcpy(&bytes, src + i, 16);
#pragma GCC unroll 4
      for (int plane = 0; plane < per_byte; ++plane) {
        const u8x16 c = (bytes >> (plane * BITS)) & mask;
        f32x16 f = __builtin_convertvector(__builtin_convertvector(c, i32x16), f32x16);
        if (scale != nullptr) {
          const int64_t g = (plane * n + i) / group;
          f = f * scale[g] + mins[g];
        }
        std::memcpy(out + plane * n + i, &f, sizeof f);
      }
    }
    for (; i < n; ++i)
      for (int plane = 0; plane < per_byte; ++plane) {
        const int64_t e = plane * n + i;
        const float c = (float)((src[i] >> (plane * BITS)) & mask);
        out[e] = scale != nullptr ? c * scale[e / group] + mins[e / group] : c;
      }
  }

  // A packed value row's (scale, min) per group of `group` channels, float16 [2][head_dim/group].
  const c10::Half* params(int64_t block, int64_t slot, int64_t h) const {
    return scales + block * param_block + slot * param_slot + h * param_head;
  }
};

// sum_d a[d] * b[d] in 16 interleaved partial sums (lane j: every d = j mod 16, in order),
// then combined as a fixed tree (j + 8, j + 4, j + 2, j + 1): one fixed order, written in GCC's
// vector types so that the sums are one 16-lane chain and the tree four vector halvings
// (-ffp-contract=off keeps each product and sum rounded as written). As plain loops the compiler
// kept the tree scalar, through the stack, costlier than the products (perf, decode at batch
// 32). Inlined: called per key and query head.

__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t n) {
  f32x16 part = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    f32x16 x, y;
    std::memcpy(&x, a + d, sizeof x);
    std::memcpy(&y, b + d, sizeof y);
    part += x * y;
  }
  for (int j = 0; d < n; ++d, ++j) part[j] += a[d] * b[d];
  return tree_sum(part);
}

// The cache a table entry names and its block there: a demoted block's int8 view below -1.
inline const Cache& cache_at(const Cache& c, int64_t entry, int64_t& block) {
  if (entry >= 0) {
    block = entry;
    return c;
  }
  block = -2 - entry;
  return *c.demoted;
}

// A float32 cache's bytes as int8 blocks of its shape, with their scales [blocks, BS, KVH].
Cache demoted_view(const at::Tensor& cache, const at::Tensor& scales) {
  const int64_t BS = cache.size(1), KVH = cache.size(2), D = cache.size(3);
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.is_contiguous() &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == 4 * cache.size(0) &&
                  scales.size(1) == BS && scales.size(2) == KVH,
              "paged_decode: demoted blocks need contiguous float32 caches and float16 scales "
              "[4 * blocks, block_size, kv_heads]");
  Cache c;
  c.kv_heads = KVH;
  c.head_dim = D;
  c.block_stride = BS * KVH * D;
  c.slot_stride = KVH * D;
  c.head_stride = D;
  c.i8 = reinterpret_cast<const int8_t*>(cache.data_ptr<float>());
  c.scales = scales.data_ptr<c10::Half>();
  c.scale_block = scales.stride(0);
  c.scale_slot = scales.stride(1);
  return c;
}

Cache cache_of(const at::Tensor& cache, const std::optional<at::Tensor>& scales) {
  Cache c;
  c.block_stride = cache.stride(0);
  c.slot_stride = cache.stride(1);
  c.head_stride = cache.stride(2);
  c.kv_heads = cache.size(2);
  c.head_dim = cache.size(3);
  if (cache.scalar_type() == at::kFloat) {
    c.f32 = cache.data_ptr<float>();
  } else {
    TORCH_CHECK(cache.scalar_type() == at::kChar && scales.has_value() &&
                    scales->scalar_type() == at::kHalf && scales->is_contiguous(),
                "paged_decode: a cache is float32, or int8 with float16 scales");
    c.i8 = cache.data_ptr<int8_t>();
    c.scales = scales->data_ptr<c10::Half>();
    c.scale_block = scales->stride(0);
    c.scale_slot = scales->stride(1);
  }
  return c;
}

// Where a row's logical key positions lie: [0, base) in place, then base + path[i] for the i-th
// key at or after base (a tree row; base is past every key for any other row).
struct Path {
  int64_t base = std::numeric_limits<int64_t>::max();
  const int64_t* path = nullptr;
  int64_t at(int64_t pos) const { return pos < base ? pos : base + path[pos - base]; }
};

// A thread's working memory: scores [H][n] and a dequantized row (int8 and packed caches); for
// a packed cache each query head folded with its kv head's key parameters (`folded` [H][D],
// `bias` [H], for the block `folded_block` [KVH], -1: none).
struct Scratch {
  std::vector<float> scores, row, folded, bias;
  std::vector<int64_t> folded_block;
};

// A packed cache's keys are scored on their codes: per channel k = code * scale + min, so
// q . k = (q * scale) . code + q . min, with q folded into a block's parameters once per
// partition and query head instead of every key dequantized.
void fold_keys(const Cache& kc, int64_t block, int64_t h, const float* q, int64_t G, Scratch& t) {
  const int64_t D = kc.head_dim;
  const c10::Half* p = kc.scales + block * kc.param_block + h * kc.param_head;
  float* scale = t.row.data();
  float* mins = scale + D;
  halves_to_floats(p, scale, 2 * D);
  for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
    float* f = t.folded.data() + hq * D;
    for (int64_t d = 0; d < D; ++d) f[d] = q[hq * D + d] * scale[d];
    t.bias[hq] = dot(q + hq * D, mins, D);
  }
  t.folded_block[h] = block;
}

// A low-bit cache's recent keys and values in float16 (attention/lowbit_cache.py): a row reads
// its positions from `limit` on from here ([rows, kv_heads, head_dim], its first at `start`)
// instead of the pool, whose block is still being filled. No row has any: limit past all.
struct Recent {
  const c10::Half* k = nullptr;
  const c10::Half* v = nullptr;
  int64_t limit = std::numeric_limits<int64_t>::max(), start = 0;

  const float* row(const c10::Half* x, int64_t pos, int64_t h, int64_t KVH, int64_t D,
                   float* out) const {
    halves_to_floats(x + ((start + pos - limit) * KVH + h) * D, out, D);
    return out;
  }
};

// One partition of a sequence's keys, positions [lo, hi), for all its KV heads: per query
// head hq (KV head hq / G) its largest score m, the sum l of exp(score - m) and the unnormalized
// sum of values acc[Dv]. A key slot's heads lie side by side in the cache, so the loops run
// over the slots and inside them over the heads: the cache streams block by block instead of
// a head's rows at a slot's stride (the sums' order per query head is unchanged: keys in order).
// DEMOTED: the tables may name demoted blocks (a cache without them keeps the plain loop).
template <bool DEMOTED>
void attend_partition(const Cache& kc, const Cache& vc, const float* q, const int64_t* table,
                      const Path& path, int64_t KVH, int64_t G, int64_t D, int64_t Dv,
                      int64_t BS, int64_t key_start, int64_t lo, int64_t hi, float sc, float* m,
                      float* l, float* acc, Scratch& t, const Recent& recent) {
  const int64_t n = hi - lo, H = KVH * G;
  std::fill(t.folded_block.begin(), t.folded_block.end(), -1);   // folded with this row's q
  std::vector<float>& scores = t.scores;
  scores.assign(H * n, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t logical = path.at(lo + j), pos = logical - key_start;
    const int64_t slot = pos % BS;
    int64_t block;
    const Cache& kk =
        DEMOTED ? cache_at(kc, table[pos / BS], block) : (block = table[pos / BS], kc);
    for (int64_t h = 0; h < KVH; ++h) {
      if (kc.packed != nullptr && logical < recent.limit) {
        if (t.folded_block[h] != block) fold_keys(kc, block, h, q, G, t);
        kc.codes(block, slot, h, t.row.data());
        for (int64_t hq = h * G; hq < (h + 1) * G; ++hq)
          scores[hq * n + j] = (dot(t.folded.data() + hq * D, t.row.data(), D) + t.bias[hq]) * sc;
        continue;
      }
      const float* k = logical >= recent.limit
                           ? recent.row(recent.k, logical, h, KVH, D, t.row.data())
                           : kk.row(block, slot, h, t.row.data());
      for (int64_t hq = h * G; hq < (h + 1) * G; ++hq)
        scores[hq * n + j] = dot(q + hq * D, k, D) * sc;
    }
  }
  for (int64_t hq = 0; hq < H; ++hq) {
    float* s = scores.data() + hq * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
    m[hq] = mx;
    l[hq] = sum;
  }
  std::fill(acc, acc + H * Dv, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t logical = path.at(lo + j), pos = logical - key_start;
    const int64_t slot = pos % BS;
    int64_t block;
    const Cache& vv =
        DEMOTED ? cache_at(vc, table[pos / BS], block) : (block = table[pos / BS], vc);
    for (int64_t h = 0; h < KVH; ++h) {
      const float* v = logical >= recent.limit
                           ? recent.row(recent.v, logical, h, KVH, Dv, t.row.data())
                           : vv.row(block, slot, h, t.row.data());
      for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
        float* o = acc + hq * Dv;
        const float w = scores[hq * n + j];
        for (int64_t d = 0; d < Dv; ++d) o[d] += w * v[d];
      }
    }
  }
}

// Per row, its Path: tree_base [B] and tree_bits [B] (bit i: position base + i is on the row's
// path), both given or both absent; the paths point into `offsets`.
std::vector<Path> tree_paths(const std::optional<at::Tensor>& tree_base,
                             const std::optional<at::Tensor>& tree_bits, int64_t B,
                             std::vector<int64_t>& offsets) {
  std::vector<Path> paths(B);
  TORCH_CHECK(tree_base.has_value() == tree_bits.has_value(),
              "paged_decode: tree_base and tree_bits come together");
  if (!tree_base.has_value()) return paths;
  TORCH_CHECK(tree_base->numel() == B && tree_bits->numel() == B,
              "paged_decode: one tree base and one ancestor mask per query");
  const at::Tensor base = tree_base->to(at::kLong).contiguous();
  const at::Tensor bits = tree_bits->to(at::kLong).contiguous();
  offsets.assign(B * 64, 0);
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t mask = (uint64_t)bits.data_ptr<int64_t>()[b];
    if (mask == 0) continue;
    int64_t n = 0;
    for (int64_t i = 0; i < 64; ++i)
      if (mask >> i & 1) offsets[b * 64 + n++] = i;
    paths[b].base = base.data_ptr<int64_t>()[b];
    paths[b].path = offsets.data() + b * 64;
  }
  return paths;
}


// Keys in partitions of PART positions, counted from position 0 (not from the batch's tables):
// the partitions of a sequence are one work item each, so one long sequence keeps every thread
// busy, and their partial softmaxes are combined in position order. Where the partitions fall
// depends on the sequence's own positions only, so its bits do not depend on the batch.
constexpr int64_t PART = 64;

// A row's keys in partitions of at most PART positions, each inside one PART-aligned run of
// positions: its sinks [key_start, min(sinks, lo)) first, then [lo, hi).
struct Item {
  int64_t row, lo, hi;
};

void add_partitions(int64_t row, int64_t lo, int64_t hi, std::vector<Item>& items) {
  for (int64_t a = lo; a < hi; a = (a / PART + 1) * PART)
    items.push_back({row, a, std::min(hi, (a / PART + 1) * PART)});
}

at::Tensor attend_rows(const at::Tensor& qc, const Cache& kc, const Cache& vc, int64_t BS,
                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                       int64_t key_start, int64_t window, double scale,
                       const std::vector<Path>& paths, int64_t sinks,
                       const std::vector<Recent>& recent);

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const std::optional<at::Tensor>& k_scales,
                        const std::optional<at::Tensor>& v_scales, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, int64_t key_start, int64_t window,
                        double scale, const std::optional<at::Tensor>& tree_base,
                        const std::optional<at::Tensor>& tree_bits, int64_t sinks,
                        const std::optional<at::Tensor>& demoted_scales) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_decode: q must be float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.stride(3) == 1 && v_cache.size(3) <= k_cache.size(3) &&
                  k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
              "paged_decode: caches must be [blocks, block_size, kv_heads, head_dim], the keys "
              "contiguous, the values as many rows of at most the keys' width");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "paged_decode: one block table and one length per query");
  std::vector<int64_t> offsets;
  const std::vector<Path> paths = tree_paths(tree_base, tree_bits, q.size(0), offsets);
  Cache kc = cache_of(k_cache, k_scales), vc = cache_of(v_cache, v_scales), dk, dv;
  if (demoted_scales.has_value()) {
    TORCH_CHECK(demoted_scales->dim() == 4 && demoted_scales->size(0) == 2,
                "paged_decode: demoted scales are [2, 4 * blocks, block_size, kv_heads]");
    dk = demoted_view(k_cache, demoted_scales->select(0, 0));
    dv = demoted_view(v_cache, demoted_scales->select(0, 1));
    kc.demoted = &dk;
    vc.demoted = &dv;
  }
  return attend_rows(q.contiguous(), kc, vc, k_cache.size(1), block_tables, context_lens,
                     key_start, window, scale, paths, sinks, std::vector<Recent>(q.size(0)));
}

at::Tensor attend_rows(const at::Tensor& qc, const Cache& kc, const Cache& vc, int64_t BS,
                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                       int64_t key_start, int64_t window, double scale,
                       const std::vector<Path>& paths, int64_t sinks,
                       const std::vector<Recent>& recent) {
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2), Dv = vc.head_dim;
  const int64_t KVH = kc.kv_heads, G = H / KVH, W = tables.size(1);
  TORCH_CHECK(D == kc.head_dim && H % KVH == 0, "paged_decode: q's heads do not fit the cache");
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  if (kc.demoted == nullptr)
    for (int64_t i = 0; i < B * W; ++i)
      TORCH_CHECK(tp[i] >= 0, "paged_decode: a table names a demoted block (below 0) without "
                              "demoted scales");
  // Each sequence's visible keys (its sinks, then [lo, hi)) and their partitions, numbered
  // across the batch: first[b] is row b's first.
  std::vector<Item> items;
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t hi = std::min(lp[b], key_start + W * BS);
    const int64_t lo = window > 0 ? std::max(key_start, lp[b] - window) : key_start;
    if (window > 0) add_partitions(b, key_start, std::min(std::min(sinks, lo), hi), items);
    add_partitions(b, lo, hi, items);
    first[b + 1] = (int64_t)items.size();
  }
  const int64_t P = first[B];
  at::Tensor out = at::zeros({B, H, Dv}, qc.options());
  std::vector<float> m(P * H), l(P * H), acc(P * H * Dv);
  const float* qp = qc.data_ptr<float>();
  const float sc = (float)scale;
  kvslim_team::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    scratch.row.resize(2 * std::max(D, Dv));     // a row, or a block's key scales and minimums
    scratch.folded.resize(H * D);
    scratch.bias.resize(H);
    scratch.folded_block.assign(KVH, -1);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b = items[p].row;
      if (kc.demoted != nullptr)
        attend_partition<true>(kc, vc, qp + b * H * D, tp + b * W, paths[b], KVH, G, D, Dv, BS,
                               key_start, items[p].lo, items[p].hi, sc, m.data() + p * H,
                               l.data() + p * H, acc.data() + p * H * Dv, scratch, recent[b]);
      else
        attend_partition<false>(kc, vc, qp + b * H * D, tp + b * W, paths[b], KVH, G, D, Dv, BS,
                                key_start, items[p].lo, items[p].hi, sc, m.data() + p * H,
                                l.data() + p * H, acc.data() + p * H * Dv, scratch, recent[b]);
    }
  });
  float* op = out.data_ptr<float>();
  kvslim_team::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, hq = item % H;
      if (first[b] == first[b + 1]) continue;   // nothing to see: zeros, as SDPA over no key
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = first[b]; p < first[b + 1]; ++p) mx = std::max(mx, m[p * H + hq]);
      float sum = 0.f;
      float* o = op + item * Dv;
      for (int64_t p = first[b]; p < first[b + 1]; ++p) {
        const float w = std::exp(m[p * H + hq] - mx);
        sum += w * l[p * H + hq];
        const float* a = acc.data() + (p * H + hq) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
    }
  });
  return out;
}

// A 4- or 2-bit cache (attention/lowbit_cache.py): keys per channel over each block, values per
// token in groups of `group`, codes packed along head_dim; each row's positions from the start
// of its own block on (of the `residual` blocks ending with its own) read from recent_k/recent_v
// (float16, [rows, kv_heads, head_dim]) at recent_start[row]. paged_decode's partitions and
// order, the keys scored on their codes (fold_keys), the values dequantized a row at a time.
Cache packed_cache(const at::Tensor& codes, const at::Tensor& params, int64_t bits, int64_t group,
                   bool per_channel) {
  Cache c;
  c.packed = codes.data_ptr<uint8_t>();
  c.scales = params.data_ptr<c10::Half>();
  c.block_stride = codes.stride(0);
  c.slot_stride = codes.stride(1);
  c.head_stride = codes.stride(2);
  c.kv_heads = codes.size(2);
  c.head_dim = codes.size(3) * 8 / bits;
  c.bits = bits;
  c.group = group;
  c.param_block = params.stride(0);
  c.param_slot = per_channel ? 0 : params.stride(1);
  c.param_head = params.stride(per_channel ? 1 : 2);
  return c;
}

at::Tensor paged_decode_lowbit(const at::Tensor& q, const at::Tensor& k_codes,
                               const at::Tensor& v_codes, const at::Tensor& k_params,
                               const at::Tensor& v_params, const at::Tensor& recent_k,
                               const at::Tensor& recent_v, const at::Tensor& recent_start,
                               const at::Tensor& block_tables, const at::Tensor& context_lens,
                               int64_t key_start, int64_t window, double scale, int64_t sinks,
                               int64_t bits, int64_t group, int64_t residual) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_decode_lowbit: q must be float32 [B, H, D]");
  TORCH_CHECK((bits == 4 || bits == 2) && k_codes.scalar_type() == at::kByte &&
                  v_codes.scalar_type() == at::kByte && k_codes.is_contiguous() &&
                  v_codes.is_contiguous() && k_codes.sizes() == v_codes.sizes(),
              "paged_decode_lowbit: codes are uint8 [blocks, block_size, kv_heads, head_dim * bits / 8] "
              "of 4 or 2 bits");
  const int64_t BS = k_codes.size(1), KVH = k_codes.size(2), D = k_codes.size(3) * 8 / bits;
  TORCH_CHECK(k_params.scalar_type() == at::kHalf && v_params.scalar_type() == at::kHalf &&
                  k_params.is_contiguous() && v_params.is_contiguous() &&
                  k_params.dim() == 4 && k_params.size(3) == D && D % group == 0 &&
                  v_params.dim() == 5 && v_params.size(4) == D / group,
              "paged_decode_lowbit: params are float16 [blocks, kv_heads, 2, head_dim] (keys) and "
              "[blocks, block_size, kv_heads, 2, head_dim / group] (values)");
  TORCH_CHECK(recent_k.scalar_type() == at::kHalf && recent_v.scalar_type() == at::kHalf &&
                  recent_k.is_contiguous() && recent_v.is_contiguous() &&
                  recent_k.sizes() == recent_v.sizes() && recent_k.size(1) == KVH &&
                  recent_k.size(2) == D && recent_start.numel() == q.size(0),
              "paged_decode_lowbit: recent keys and values are float16 [rows, kv_heads, head_dim], "
              "one start per query");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "paged_decode_lowbit: one block table and one length per query");
  const at::Tensor starts = recent_start.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  const int64_t M = recent_k.size(0);
  std::vector<Recent> recent(q.size(0));
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t n = lens.data_ptr<int64_t>()[b];
    recent[b] = {recent_k.data_ptr<c10::Half>(), recent_v.data_ptr<c10::Half>(),
                 n > 0 ? std::max<int64_t>(0, (n - 1) / BS - residual + 1) * BS : 0,
                 starts.data_ptr<int64_t>()[b]};
    TORCH_CHECK(n <= 0 || (recent[b].start >= 0 && recent[b].start + n - recent[b].limit <= M),
                "paged_decode_lowbit: a row's recent keys lie outside recent_k");
  }
  return attend_rows(q.contiguous(), packed_cache(k_codes, k_params, bits, 1, true),
                     packed_cache(v_codes, v_params, bits, group, false), BS, block_tables,
                     context_lens, key_start, window, scale, std::vector<Path>(q.size(0)), sinks,
                     recent);
}

}  // namespace kvslim_paged_attention

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scales, Tensor? v_scales, "
        "Tensor block_tables, Tensor context_lens, int key_start, int window, float scale, "
        "Tensor? tree_base=None, Tensor? tree_bits=None, int sinks=0, "
        "Tensor? demoted_scales=None) -> Tensor");
  m.def("paged_decode_lowbit(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_params, "
        "Tensor v_params, Tensor recent_k, Tensor recent_v, Tensor recent_start, "
        "Tensor block_tables, Tensor context_lens, int key_start, int window, float scale, "
        "int sinks, int bits, int group, int residual=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("paged_decode", &kvslim_paged_attention::paged_decode);
  m.impl("paged_decode_lowbit", &kvslim_paged_attention::paged_decode_lowbit);
}
