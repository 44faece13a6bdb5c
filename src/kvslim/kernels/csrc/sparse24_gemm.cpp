// y = x @ w^T for a 2:4-sparse float32 weight: at most two of every four consecutive inputs
// of a row are nonzero, and only those two are stored, with their positions in the group.
//
// Per output element the kernel runs one chain of fused multiply-adds over the groups of four
// inputs in order, and within a group over its two kept weights (lower position first):
//
//     acc = 0;  for g: acc = fma(v0[n, g], x[4g + p0[n, g]], acc);
//                      acc = fma(v1[n, g], x[4g + p1[n, g]], acc)
//
// whatever the number of rows, a row's place in the call, the tiling or the threads: the batch
// invariance the engine needs. The AVX2 and scalar paths run the same sequence per lane, so
// both give the same bits (an AVX-512 build runs the AVX2 path).
//
// Layout (kvslim/kernels/sparse24.py packs it): output columns in tiles of 16, as tiled_mm's.
// values: float32 [tiles][groups][2][16] (a group's first kept weight of the 16 columns, then
// the second); index: uint32 [tiles][groups][2], word h for columns 8h..8h+7, nibble j of it
// p0 | p1 << 2 of column 8h + j. A group-tile is 128 bytes of values and 8 of positions, 136
// bytes against tiled_mm's 256: the point of the format at batch 1, where a call's time is
// its bytes. The AVX2 path picks each lane's activation with one in-lane permute of the
// group's four inputs (vpermilps reads only an index's low two bits, so a shift of the
// position word is the whole decode).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvslim_sparse24_gemm {

constexpr int NT = 16;            // output columns per tile
constexpr int CT = 4;             // tiles per work item (and at most per micro-kernel call)
constexpr int RMAX = 4;           // rows per micro-kernel call when there are many
constexpr int FEW_ROWS = 2;       // up to this many rows, one call takes all of an item's tiles
constexpr int64_t M_CHUNK = 64;   // rows whose x stays in cache while a thread walks the tiles

#if defined(__AVX2__) && defined(__FMA__)
struct Acc {
  __m256 a, b;
  static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  void store(float* p, int n) const {
    float tmp[NT];
    _mm256_storeu_ps(tmp, a);
    _mm256_storeu_ps(tmp + 8, b);
    for (int j = 0; j < n; ++j) p[j] = tmp[j];
  }
};
// One group-tile: its kept weights and the positions, as permute indices per lane.
struct Group {
  __m256 v0a, v0b, v1a, v1b;
  __m256i p0a, p0b, p1a, p1b;
  static Group load(const float* v, const uint32_t* ix) {
    const __m256i s0 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i s1 = _mm256_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30);
    const __m256i wa = _mm256_set1_epi32((int)ix[0]), wb = _mm256_set1_epi32((int)ix[1]);
    return {_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8), _mm256_loadu_ps(v + 16),
            _mm256_loadu_ps(v + 24), _mm256_srlv_epi32(wa, s0), _mm256_srlv_epi32(wb, s0),
            _mm256_srlv_epi32(wa, s1), _mm256_srlv_epi32(wb, s1)};
  }
  void apply(const float* x4, Acc& acc) const {
    const __m256 xq = _mm256_broadcast_ps((const __m128*)x4);
    acc.a = _mm256_fmadd_ps(v0a, _mm256_permutevar_ps(xq, p0a), acc.a);
    acc.b = _mm256_fmadd_ps(v0b, _mm256_permutevar_ps(xq, p0b), acc.b);
    acc.a = _mm256_fmadd_ps(v1a, _mm256_permutevar_ps(xq, p1a), acc.a);
    acc.b = _mm256_fmadd_ps(v1b, _mm256_permutevar_ps(xq, p1b), acc.b);
  }
};
#else
struct Acc {
  float v[NT];
  static Acc zero() { Acc r; for (int j = 0; j < NT; ++j) r.v[j] = 0.f; return r; }
  void store(float* p, int n) const { for (int j = 0; j < n; ++j) p[j] = v[j]; }
};
struct Group {
  const float* v;
  uint8_t p0[NT], p1[NT];
  static Group load(const float* v, const uint32_t* ix) {
    Group g;
    g.v = v;
    for (int j = 0; j < NT; ++j) {
      const uint32_t nib = ix[j / 8] >> (4 * (j % 8));
      g.p0[j] = nib & 3;
      g.p1[j] = (nib >> 2) & 3;
    }
    return g;
  }
  void apply(const float* x4, Acc& acc) const {
    for (int j = 0; j < NT; ++j) acc.v[j] = std::fma(v[j], x4[p0[j]], acc.v[j]);
    for (int j = 0; j < NT; ++j) acc.v[j] = std::fma(v[NT + j], x4[p1[j]], acc.v[j]);
  }
};
#endif

struct Problem {
  const float* x;        // [M, K]
  const float* v;        // [tiles, groups, 2, NT]
  const uint32_t* ix;    // [tiles, groups, 2]
  float* y;              // [M, N]
  int64_t M, K, N, groups;
};

// Rows r0..r0+R of tiles t0..t0+C; R and C are template arguments so that the accumulators
// live in registers. Neither changes what a row's element computes.
template <int R, int C>
void tile_block(const Problem& p, int64_t r0, int64_t t0) {
  Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Acc::zero();
  const float* x = p.x + r0 * p.K;
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int c = 0; c < C; ++c) {
      const int64_t at = (t0 + c) * p.groups + g;
      const Group grp = Group::load(p.v + at * 2 * NT, p.ix + at * 2);
      for (int r = 0; r < R; ++r) grp.apply(x + r * p.K + 4 * g, acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int cols = (int)std::min<int64_t>(NT, p.N - (t0 + c) * NT);
    for (int r = 0; r < R; ++r) acc[r][c].store(p.y + (r0 + r) * p.N + (t0 + c) * NT, cols);
  }
}

using BlockFn = void (*)(const Problem&, int64_t, int64_t);

template <int C, int... R>
constexpr std::array<BlockFn, sizeof...(R)> row_table(std::integer_sequence<int, R...>) {
  return {&tile_block<R + 1, C>...};
}

BlockFn kernel(int64_t rows, int64_t tiles) {
  using Rows = std::make_integer_sequence<int, RMAX>;
  static const std::array<std::array<BlockFn, RMAX>, CT> table = {
      row_table<1>(Rows{}), row_table<2>(Rows{}), row_table<3>(Rows{}), row_table<4>(Rows{})};
  return table[tiles - 1][rows - 1];
}

// Rows begin..end of the tiles t0..t0+n (n <= CT): few rows take all n tiles at once (n
// independent chains for one row), more go RMAX rows of one tile at a time.
void block_of(const Problem& p, int64_t begin, int64_t end, int64_t t0, int64_t n) {
  if (end - begin <= FEW_ROWS) {
    kernel(end - begin, n)(p, begin, t0);
    return;
  }
  for (int64_t t = t0; t < t0 + n; ++t)
    for (int64_t r = begin; r < end; r += RMAX)
      kernel(std::min<int64_t>(RMAX, end - r), 1)(p, r, t);
}

at::Tensor sparse24_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& index,
                       int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "sparse24_mm: x must be 2-D float32");
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.dim() == 2 && values.is_contiguous(),
              "sparse24_mm: values must be contiguous float32 [tiles, in / 4 * 32]");
  TORCH_CHECK(index.scalar_type() == at::kInt && index.dim() == 2 && index.is_contiguous(),
              "sparse24_mm: index must be contiguous int32 [tiles, in / 4 * 2]");
  const at::Tensor xc = x.contiguous();
  Problem p{};
  p.M = xc.size(0); p.K = xc.size(1); p.N = n;
  TORCH_CHECK(p.K % 4 == 0, "sparse24_mm: ", p.K, " inputs are not whole groups of 4");
  p.groups = p.K / 4;
  const int64_t tiles = values.size(0);
  TORCH_CHECK(n > 0 && tiles == (n + NT - 1) / NT && values.size(1) == p.groups * 2 * NT &&
                  index.size(0) == tiles && index.size(1) == p.groups * 2,
              "sparse24_mm: weight shape does not match");
  at::Tensor y = at::empty({p.M, n}, xc.options());
  if (p.M == 0) return y;
  p.x = xc.data_ptr<float>();
  p.v = values.data_ptr<float>();
  p.ix = (const uint32_t*)index.data_ptr<int32_t>();
  p.y = y.data_ptr<float>();
  const int64_t chunks = (p.M + M_CHUNK - 1) / M_CHUNK;
  const int64_t blocks = (tiles + CT - 1) / CT;
  kvslim_team::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / blocks, t0 = (i % blocks) * CT;
      const int64_t r0 = c * M_CHUNK, r1 = std::min(p.M, r0 + M_CHUNK);
      block_of(p, r0, r1, t0, std::min<int64_t>(CT, tiles - t0));
    }
  });
  return y;
}


}  // namespace kvslim_sparse24_gemm

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("sparse24_mm(Tensor x, Tensor values, Tensor index, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("sparse24_mm", &kvslim_sparse24_gemm::sparse24_mm); }
