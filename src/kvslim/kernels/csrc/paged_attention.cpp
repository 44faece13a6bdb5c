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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvslim_paged_attention {

struct Cache {
  const float* f32 = nullptr;         // float32 elements, or
  const int8_t* i8 = nullptr;         // int8 elements with
  const c10::Half* scales = nullptr;  // their scales
  int64_t block_stride, slot_stride, head_stride;   // elements per block, slot, kv head
  int64_t scale_block, scale_slot;                   // scales per block, per slot
  int64_t kv_heads, head_dim;

  // Row `slot` of `block` for kv head `h` as float32: the cache's own row (float32), or
  // `out` [head_dim] holding it dequantized (int8).
  const float* row(int64_t block, int64_t slot, int64_t h, float* out) const {
    const int64_t at = block * block_stride + slot * slot_stride + h * head_stride;
    if (f32 != nullptr) return f32 + at;
    const float s = (float)scales[block * scale_block + slot * scale_slot + h];
    for (int64_t d = 0; d < head_dim; ++d) out[d] = (float)i8[at + d] * s;
    return out;
  }
};

// sum_d a[d] * b[d] in 16 interleaved partial sums (lane j: every d = j mod 16, in order),
// then combined as a fixed tree (j + 8, j + 4, j + 2, j + 1): one fixed order that the
// compiler vectorizes into one 16-lane chain (-ffp-contract=off keeps each product and sum
// rounded as written). Inlined: called per key and query head, its call and its partial sums'
// trip through memory cost more than its 64 multiply-adds.
__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[d + j] * b[d + j];
  for (int j = 0; d < n; ++d, ++j) part[j] += a[d] * b[d];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  return part[0];
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

// A thread's working memory: scores [H][n] and a dequantized row (int8 caches).
struct Scratch {
  std::vector<float> scores, row;
};

// One partition of a sequence's keys, positions [lo, hi), for all its KV heads: per query
// head hq (KV head hq / G) its largest score m, the sum l of exp(score - m) and the unnormalized
// sum of values acc[Dv]. A key slot's heads lie side by side in the cache, so the loops run
// over the slots and inside them over the heads: the cache streams block by block instead of
// a head's rows at a slot's stride (the sums' order per query head is unchanged: keys in order).
void attend_partition(const Cache& kc, const Cache& vc, const float* q, const int64_t* table,
                      const Path& path, int64_t KVH, int64_t G, int64_t D, int64_t Dv,
                      int64_t BS, int64_t key_start, int64_t lo, int64_t hi, float sc, float* m,
                      float* l, float* acc, Scratch& t) {
  const int64_t n = hi - lo, H = KVH * G;
  std::vector<float>& scores = t.scores;
  scores.assign(H * n, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = path.at(lo + j) - key_start;
    const int64_t block = table[pos / BS], slot = pos % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* k = kc.row(block, slot, h, t.row.data());
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
    const int64_t pos = path.at(lo + j) - key_start;
    const int64_t block = table[pos / BS], slot = pos % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* v = vc.row(block, slot, h, t.row.data());
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

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const std::optional<at::Tensor>& k_scales,
                        const std::optional<at::Tensor>& v_scales, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, int64_t key_start, int64_t window,
                        double scale, const std::optional<at::Tensor>& tree_base,
                        const std::optional<at::Tensor>& tree_bits) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_decode: q must be float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.stride(3) == 1 && v_cache.size(3) <= k_cache.size(3) &&
                  k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
              "paged_decode: caches must be [blocks, block_size, kv_heads, head_dim], the keys "
              "contiguous, the values as many rows of at most the keys' width");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "paged_decode: one block table and one length per query");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  const Cache kc = cache_of(k_cache, k_scales), vc = cache_of(v_cache, v_scales);
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2), Dv = vc.head_dim;
  const int64_t KVH = kc.kv_heads, G = H / KVH, BS = k_cache.size(1), W = tables.size(1);
  TORCH_CHECK(D == kc.head_dim && H % KVH == 0, "paged_decode: q's heads do not fit the cache");
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> offsets;
  const std::vector<Path> paths = tree_paths(tree_base, tree_bits, B, offsets);
  // Each sequence's visible keys [lo, hi) and its partitions, numbered across the batch.
  std::vector<int64_t> lo(B), hi(B), first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    hi[b] = std::min(lp[b], key_start + W * BS);
    lo[b] = window > 0 ? std::max(key_start, lp[b] - window) : key_start;
    const int64_t parts = hi[b] > lo[b] ? (hi[b] - 1) / PART - lo[b] / PART + 1 : 0;
    first[b + 1] = first[b] + parts;
  }
  const int64_t P = first[B];
  at::Tensor out = at::zeros({B, H, Dv}, qc.options());
  std::vector<float> m(P * H), l(P * H), acc(P * H * Dv);
  std::vector<int64_t> seq_of(P);
  for (int64_t b = 0; b < B; ++b) std::fill(seq_of.begin() + first[b], seq_of.begin() + first[b + 1], b);
  const float* qp = qc.data_ptr<float>();
  const float sc = (float)scale;
  kvslim_team::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    scratch.row.resize(D);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b = seq_of[p];
      const int64_t c = lo[b] / PART + (p - first[b]);
      const int64_t a = std::max(lo[b], c * PART), z = std::min(hi[b], (c + 1) * PART);
      attend_partition(kc, vc, qp + b * H * D, tp + b * W, paths[b], KVH, G, D, Dv, BS,
                       key_start, a, z, sc, m.data() + p * H, l.data() + p * H,
                       acc.data() + p * H * Dv, scratch);
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

}  // namespace kvslim_paged_attention

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scales, Tensor? v_scales, "
        "Tensor block_tables, Tensor context_lens, int key_start, int window, float scale, "
        "Tensor? tree_base=None, Tensor? tree_bits=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("paged_decode", &kvslim_paged_attention::paged_decode); }
