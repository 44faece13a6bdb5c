// Many LoRA adapters in one batch (Punica's SGMV: each row of a batch through its own
// adapter): y[t] += B[s] (A[s] x[t]) for s = slots[t], rows with slot -1 left untouched.
//
// A layer's fused linear (q/k/v, gate/up) has n output shards, each with its own A [R, in] and
// B [rows, R]: a [S, n*R, in] stacks a slot's A matrices, b [S, out, R] holds each output row's
// coefficients on its shard's rank vector (the scaling folded in). Two steps, each a set of dot
// products: u[t, j*R + r] = a[s, j*R + r, :] . x[t, :], then y[t, o] += b[s, o, :] . u[t, j(o)].
//
// Every dot product is one fixed order, whatever the number of rows, the threads or the split:
// 16 interleaved partial sums (lane l: every element l mod 16, in order), then a fixed tree
// (l + 8, l + 4, l + 2, l + 1), as paged_attention.cpp's dot; in GCC's vector types, so that the
// AVX-512, AVX2 and scalar builds run the same operations (-ffp-contract=off: a product and a
// sum, each rounded). What a batch changes is only the schedule: rows of one slot are taken
// together (an A or B row loaded once for several tokens), several dot products interleaved
// (one chain waits on the add's latency), and the work split over rows x A rows, then rows x
// output blocks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
#include "vec_tree.h"
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace kvslim_lora_sgmv {

using kvslim_vec::f32x16;
using kvslim_vec::f32x8;
using kvslim_vec::f32x4;
using kvslim_vec::f32x2;
using kvslim_vec::tree_sum;

#if defined(__AVX512F__)
constexpr int GMAX = 4;            // tokens of one slot per micro-kernel: 4 x 4 accumulators
#else
constexpr int GMAX = 2;            // 16 ymm registers: half the accumulators
#endif
constexpr int NA = 4;              // A rows per micro-kernel
constexpr int64_t A_BLOCK = 8;     // A rows per work item
constexpr int64_t O_BLOCK = 128;   // outputs per work item (whole blocks of 16)
// Multiply-adds a thread takes at least (a few microseconds): a smaller call (one token of a
// small model) runs on its own thread, where waking the others costs more than it saves.
constexpr int64_t MIN_WORK = 1 << 16;

__attribute__((always_inline)) inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The first n (< 16) lanes of p, the others zero.
inline f32x16 load_part(const float* p, int64_t n) {
  f32x16 v = {};
  if (n == 8) {
    std::memcpy(&v, p, 8 * sizeof(float));
  } else {
    for (int64_t l = 0; l < n; ++l) v[l] = p[l];
  }
  return v;
}

// tree_sum of 16 vectors at once, lane k = tree_sum(p[k]): the same tree, each level two vectors'
// halves side by side (15 adds for 16 sums instead of 60).
inline f32x16 tree_sum16(const f32x16* p) {
  f32x16 w[8], x[4], z[2];
  for (int i = 0; i < 8; ++i)
    w[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    z[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// What one call works on. Active rows are taken in slot order (`order`, then `groups`: runs of
// at most GMAX rows of one slot, as begin offsets into `order`); u is [rows in order][n*R].
struct Problem {
  const float* x;
  float* y;
  const float* a;
  const float* b;
  float* u;
  const int64_t* slots;
  const int64_t* order;
  const int64_t* groups;        // [num_groups + 1]
  const int64_t* shard_end;     // [n]: each shard's end among the outputs
  int64_t num_groups, x_stride, in, out, rank, na;
};

// u for the G rows order[p0 .. p0 + G) (one slot) and A rows k0 .. k0 + NA (clamped at na: a
// missing row repeats the last one and is not stored).
template <int G>
void a_block(const Problem& p, int64_t p0, int64_t k0) {
  const int64_t s = p.slots[p.order[p0]], in = p.in;
  const float* xr[G];
  for (int g = 0; g < G; ++g) xr[g] = p.x + p.order[p0 + g] * p.x_stride;
  const float* ar[NA];
  for (int k = 0; k < NA; ++k) ar[k] = p.a + (s * p.na + std::min(k0 + k, p.na - 1)) * in;
  f32x16 acc[G][NA] = {};
  int64_t d = 0;
  for (; d + 16 <= in; d += 16) {
    f32x16 xv[G];
    for (int g = 0; g < G; ++g) xv[g] = load16(xr[g] + d);
    for (int k = 0; k < NA; ++k) {
      const f32x16 av = load16(ar[k] + d);
      for (int g = 0; g < G; ++g) acc[g][k] += av * xv[g];
    }
  }
  for (int l = 0; d < in; ++d, ++l)
    for (int k = 0; k < NA; ++k)
      for (int g = 0; g < G; ++g) acc[g][k][l] += ar[k][d] * xr[g][d];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < NA && k0 + k < p.na; ++k)
      p.u[(p0 + g) * p.na + k0 + k] = tree_sum(acc[g][k]);
}

// b[s, o, :] . u_row[0 .. R) as 16 lanes, before the tree. Inlined where R is a constant.
__attribute__((always_inline)) inline f32x16 b_part(const float* b, const float* u, int64_t rank) {
  if (rank < 16) return load_part(b, rank) * load_part(u, rank);
  f32x16 part = load16(b) * load16(u);
  int64_t r = 16;
  for (; r + 16 <= rank; r += 16) part += load16(b + r) * load16(u + r);
  if (r < rank) part += load_part(b + r, rank - r) * load_part(u + r, rank - r);
  return part;
}

// y for the rows order[p0 .. p1) (one slot), outputs o0 .. o1; RK = the rank where it is one
// of the usual ones (the products unrolled), 0 for any other.
template <int RK>
void b_block(const Problem& p, int64_t p0, int64_t p1, int64_t o0, int64_t o1) {
  const int64_t s = p.slots[p.order[p0]], R = RK ? RK : p.rank;
  int64_t shard = 0;
  for (int64_t ob = o0; ob < o1; ob += 16) {
    const int64_t nb = std::min<int64_t>(16, o1 - ob);
    while (ob >= p.shard_end[shard]) ++shard;
    // One shard for all 16 outputs (the usual case): its rank vector loaded once a row.
    const bool one_shard = nb == 16 && ob + 15 < p.shard_end[shard];
    int64_t u_at[16];                              // each output's rank vector within a u row
    for (int64_t k = 0, j = shard; k < 16; ++k) {
      while (k < nb && ob + k >= p.shard_end[j]) ++j;
      u_at[k] = j * R;
    }
    const float* brow = p.b + (s * p.out + ob) * R;
    for (int64_t q = p0; q < p1; ++q) {
      const float* u = p.u + q * p.na;
      f32x16 part[16];
      if (one_shard) {
        for (int k = 0; k < 16; ++k) part[k] = b_part(brow + k * R, u + shard * R, R);
      } else {
        for (int k = 0; k < 16; ++k)
          part[k] = k < nb ? b_part(brow + k * R, u + u_at[k], R) : f32x16{};
      }
      const f32x16 sum = tree_sum16(part);
      float* y = p.y + p.order[q] * p.out + ob;
      if (nb == 16) {
        const f32x16 yv = load16(y) + sum;
        std::memcpy(y, &yv, sizeof yv);
      } else {
        for (int64_t k = 0; k < nb; ++k) y[k] += sum[k];
      }
    }
  }
}

using BFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

BFn b_kernel(int64_t rank) {
  switch (rank) {
    case 8: return &b_block<8>;
    case 16: return &b_block<16>;
    case 32: return &b_block<32>;
    case 64: return &b_block<64>;
    default: return &b_block<0>;
  }
}

// f over [0, items), each item about `work` multiply-adds, split over the threads.
template <class F>
void split(int64_t items, int64_t work, const F& f) {
  if (items * work < 2 * MIN_WORK) {
    f(0, items);
    return;
  }
  kvslim_team::parallel_for(0, items, (MIN_WORK + work - 1) / std::max<int64_t>(work, 1), f);
}

int64_t total_work(const Problem& p) {
  return p.groups[p.num_groups] * (p.na * p.in + p.out * p.rank);
}

// The A rows a_block(i) covers, i = group * a_blocks + block, each NA at a time.
void a_item(const Problem& p, int64_t i, int64_t a_blocks) {
  const int64_t g = i / a_blocks, k_end = std::min(p.na, (i % a_blocks + 1) * A_BLOCK);
  const int64_t p0 = p.groups[g], rows = p.groups[g + 1] - p0;
  for (int64_t k = (i % a_blocks) * A_BLOCK; k < k_end; k += NA) {
    switch (rows) {
      case 1: a_block<1>(p, p0, k); break;
#if defined(__AVX512F__)
      case 2: a_block<2>(p, p0, k); break;
      case 3: a_block<3>(p, p0, k); break;
#endif
      default: a_block<GMAX>(p, p0, k); break;
    }
  }
}

// u for every active row (groups x blocks of A rows), then y (groups x blocks of outputs).
void run(const Problem& p) {
  const int64_t active = p.groups[p.num_groups], per_group = active / p.num_groups;
  const int64_t a_blocks = (p.na + A_BLOCK - 1) / A_BLOCK;
  split(p.num_groups * a_blocks, A_BLOCK * p.in * per_group, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a_item(p, i, a_blocks);
  });
  const int64_t o_blocks = (p.out + O_BLOCK - 1) / O_BLOCK;
  const BFn b_block = b_kernel(p.rank);
  split(p.num_groups * o_blocks, O_BLOCK * p.rank * per_group, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / o_blocks, o0 = (i % o_blocks) * O_BLOCK;
      b_block(p, p.groups[g], p.groups[g + 1], o0, std::min(p.out, o0 + O_BLOCK));
    }
  });
}

void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
           const at::Tensor& b, at::IntArrayRef shard_rows) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "lora_add_: y, x, a and b must be float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "lora_add_: slots must be int64");
  TORCH_CHECK(x.device().is_cpu() && slots.device().is_cpu() && a.device().is_cpu() &&
                  b.device().is_cpu(), "lora_add_: every tensor must be on the CPU");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && slots.dim() == 1 && a.dim() == 3 && b.dim() == 3,
              "lora_add_: y [T, out], x [T, in], slots [T], a [S, n*R, in], b [S, out, R]");
  TORCH_CHECK(y.is_contiguous() && a.is_contiguous() && b.is_contiguous() &&
                  slots.is_contiguous() && x.stride(1) == 1,
              "lora_add_: y, slots, a and b must be contiguous, x's rows too");
  const int64_t T = x.size(0), S = a.size(0), out = y.size(1), R = b.size(2);
  const int64_t n = (int64_t)shard_rows.size();
  TORCH_CHECK(y.size(0) == T && slots.size(0) == T, "lora_add_: y, x and slots need the same ",
              "rows, got ", y.size(0), ", ", T, " and ", slots.size(0));
  TORCH_CHECK(n >= 1 && R >= 1, "lora_add_: at least one shard and a rank of at least 1");
  TORCH_CHECK(b.size(0) == S && b.size(1) == out, "lora_add_: b must be [S, out, R] = [", S,
              ", ", out, ", R], got ", b.sizes());
  TORCH_CHECK(a.size(1) == n * R && a.size(2) == x.size(1),
              "lora_add_: a must be [S, n*R, in] = [", S, ", ", n * R, ", ", x.size(1), "], got ",
              a.sizes());
  int64_t total = 0;
  for (int64_t rows : shard_rows) {
    TORCH_CHECK(rows >= 0, "lora_add_: shard_rows must not be negative, got ", shard_rows);
    total += rows;
  }
  TORCH_CHECK(total == out, "lora_add_: shard_rows ", shard_rows, " sum to ", total,
              ", not y's ", out, " outputs");
}

void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
               const at::Tensor& b, at::IntArrayRef shard_rows) {
  check(y, x, slots, a, b, shard_rows);
  const int64_t T = x.size(0), S = a.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Active rows in slot order (a counting sort; stable), then runs of at most GMAX.
  thread_local std::vector<int64_t> count, order, groups, shard_end;
  thread_local std::vector<float> u;
  count.assign(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= -1 && sp[t] < S, "lora_add_: slot ", sp[t], " of row ", t,
                " is out of range [-1, ", S, ")");
    if (sp[t] >= 0) ++count[sp[t] + 1];
  }
  for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
  const int64_t active = count[S];
  if (active == 0) return;
  order.resize(active);
  for (int64_t t = 0; t < T; ++t)
    if (sp[t] >= 0) order[count[sp[t]]++] = t;
  groups.clear();
  for (int64_t q = 0; q < active; ++q)
    if (q == 0 || sp[order[q]] != sp[order[q - 1]] || q - groups.back() == GMAX)
      groups.push_back(q);
  groups.push_back(active);
  shard_end.clear();
  for (int64_t rows : shard_rows)
    shard_end.push_back((shard_end.empty() ? 0 : shard_end.back()) + rows);
  const int64_t na = a.size(1);
  if ((int64_t)u.size() < active * na) u.resize(active * na);
  Problem p{x.data_ptr<float>(), y.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
            u.data(), sp, order.data(), groups.data(), shard_end.data(),
            (int64_t)groups.size() - 1, x.stride(0), x.size(1), y.size(1), b.size(2), na};
  if (total_work(p) < 2 * MIN_WORK)
    run(p);
  else
    kvslim_team::with_team([&] { run(p); });
}

}  // namespace kvslim_lora_sgmv

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor slots, Tensor a, Tensor b, int[] shard_rows)"
        " -> ()");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("lora_add_", &kvslim_lora_sgmv::lora_add_); }
