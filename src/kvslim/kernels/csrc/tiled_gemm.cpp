// y = x @ w^T for group-quantized weights, float32 activations and float32 accumulation.
//
//   4-bit:  w[n, k] = q[n, k] * s[n, g] + m[n, g]      q in 0..15 (GGUF Q4_0, Q4_1, Q4_K)
//   8-bit:  w[n, k] = q[n, k] * s[n, g]                q in -128..127 (Q8_0, Q5_0, Q6_K)
//
// with g = k / group. Per output element and group the kernel sums x[k] * q[n, k] over the
// group's k in order (one fused multiply-add each), then adds s * that sum and m * (the
// group's sum of x, also in order): every element's arithmetic is one fixed sequence, whatever
// the number of rows, a row's place in the call, the tiling or the threads. That is the batch
// invariance the engine needs; the vector widths below (AVX-512, AVX2, scalar) run the same
// sequence per lane, so all three give the same bits.
//
// Layout (kvslim/kernels/tiled_gemm.py packs it): output columns in tiles of 16; a tile's
// weights are [groups][k][16] bytes for 8-bit and [groups][k / 2][16] for 4-bit (the low
// nibble holds k, the high one k + 1); scales and mins are [tiles][groups][16] float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
#include <torch/library.h>

#include "group_sums.h"

#include <array>
#include <cmath>
#include <utility>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvslim_tiled_gemm {

constexpr int NT = 16;            // output columns per tile
constexpr int CT = 4;             // tiles per work item (and at most per micro-kernel call)
constexpr int RMAX = 6;           // rows per micro-kernel call
constexpr int FEW_ROWS = 3;       // up to this many rows, one call takes all of an item's tiles
constexpr int64_t M_CHUNK = 64;   // rows whose x stays in cache while a thread walks the tiles

#if defined(__AVX512F__)
const char* kIsa = "avx512";
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec bcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec int8s(const uint8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
  }
  static void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo.v = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  void store(float* p, int n) const {
    if (n == NT) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
const char* kIsa = "avx2";
struct Vec {
  __m256 a, b;
  static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec bcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec int8s(const uint8_t* p) {
    __m128i q = _mm_loadu_si128((const __m128i*)p);
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
  }
  static void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
    __m128i q = _mm_loadu_si128((const __m128i*)p);
    __m256i b0 = _mm256_cvtepu8_epi32(q), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
    __m256i mask = _mm256_set1_epi32(15);
    lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)),
          _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask))};
    hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
          _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
  }
  static Vec fma(Vec x, Vec y, Vec c) {
    return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)};
  }
  void store(float* p, int n) const {
    float tmp[NT];
    _mm256_storeu_ps(tmp, a);
    _mm256_storeu_ps(tmp + 8, b);
    for (int j = 0; j < n; ++j) p[j] = tmp[j];
  }
};
#else
const char* kIsa = "scalar";
struct Vec {
  float v[NT];
  static Vec zero() { Vec r; for (int j = 0; j < NT; ++j) r.v[j] = 0.f; return r; }
  static Vec bcast(float x) { Vec r; for (int j = 0; j < NT; ++j) r.v[j] = x; return r; }
  static Vec load(const float* p) { Vec r; for (int j = 0; j < NT; ++j) r.v[j] = p[j]; return r; }
  static Vec int8s(const uint8_t* p) {
    Vec r;
    for (int j = 0; j < NT; ++j) r.v[j] = (float)(int8_t)p[j];
    return r;
  }
  static void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
    for (int j = 0; j < NT; ++j) { lo.v[j] = (float)(p[j] & 15); hi.v[j] = (float)(p[j] >> 4); }
  }
  static Vec fma(Vec x, Vec y, Vec c) {
    Vec r;
    for (int j = 0; j < NT; ++j) r.v[j] = std::fma(x.v[j], y.v[j], c.v[j]);
    return r;
  }
  void store(float* p, int n) const { for (int j = 0; j < n; ++j) p[j] = v[j]; }
};
#endif

struct Problem {
  const float* x;        // [M, K]
  const float* xsum;     // [M, groups]: each group's sum of x, for the 4-bit offsets
  const uint8_t* w;      // [tiles, tile_bytes]
  const float* s;        // [tiles, groups, NT]
  const float* m;        // [tiles, groups, NT] (4-bit only)
  float* y;              // [M, N]
  int64_t M, K, N, groups, group, tile_bytes;
};

// Rows r0..r0+R of tiles t0..t0+C. R and C are template arguments so that the accumulators
// live in registers; C tiles side by side give a single row C independent chains of
// multiply-adds (one chain is bound by the FMA's latency). Neither changes what a row's
// element computes.
template <int R, int C, int BITS>
void tile_block(const Problem& p, int64_t r0, int64_t t0) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  const float* x = p.x + r0 * p.K;
  const int64_t group_bytes = p.group * NT * BITS / 8;
  for (int64_t g = 0; g < p.groups; ++g) {
    Vec part[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) part[r][c] = Vec::zero();
    const float* xg = x + g * p.group;
    const uint8_t* wg = p.w + t0 * p.tile_bytes + g * group_bytes;
    if (BITS == 4) {
      for (int64_t k = 0; k < p.group; k += 2) {
        for (int c = 0; c < C; ++c) {
          Vec lo, hi;
          Vec::nibbles(wg + c * p.tile_bytes + (k / 2) * NT, lo, hi);
          for (int r = 0; r < R; ++r) {
            part[r][c] = Vec::fma(Vec::bcast(xg[r * p.K + k]), lo, part[r][c]);
            part[r][c] = Vec::fma(Vec::bcast(xg[r * p.K + k + 1]), hi, part[r][c]);
          }
        }
      }
    } else if (BITS == 32) {
      for (int64_t k = 0; k < p.group; ++k) {
        for (int c = 0; c < C; ++c) {
          Vec w = Vec::load((const float*)(wg + c * p.tile_bytes) + k * NT);
          for (int r = 0; r < R; ++r)
            part[r][c] = Vec::fma(Vec::bcast(xg[r * p.K + k]), w, part[r][c]);
        }
      }
    } else {
      for (int64_t k = 0; k < p.group; ++k) {
        for (int c = 0; c < C; ++c) {
          Vec q = Vec::int8s(wg + c * p.tile_bytes + k * NT);
          for (int r = 0; r < R; ++r)
            part[r][c] = Vec::fma(Vec::bcast(xg[r * p.K + k]), q, part[r][c]);
        }
      }
    }
    if (BITS == 32) {                 // one group, no scale
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = part[r][c];
      continue;
    }
    for (int c = 0; c < C; ++c) {
      const int64_t at = ((t0 + c) * p.groups + g) * NT;
      Vec sv = Vec::load(p.s + at);
      for (int r = 0; r < R; ++r) acc[r][c] = Vec::fma(sv, part[r][c], acc[r][c]);
      if (BITS == 4) {
        Vec mv = Vec::load(p.m + at);
        for (int r = 0; r < R; ++r)
          acc[r][c] = Vec::fma(mv, Vec::bcast(p.xsum[(r0 + r) * p.groups + g]), acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int cols = (int)std::min<int64_t>(NT, p.N - (t0 + c) * NT);
    for (int r = 0; r < R; ++r) acc[r][c].store(p.y + (r0 + r) * p.N + (t0 + c) * NT, cols);
  }
}

using BlockFn = void (*)(const Problem&, int64_t, int64_t);

template <int BITS, int C, int... R>
constexpr std::array<BlockFn, sizeof...(R)> row_table(std::integer_sequence<int, R...>) {
  return {&tile_block<R + 1, C, BITS>...};
}

// kernel<BITS>(R, C): the micro-kernel for R rows (1..RMAX) and C tiles (1..CT).
template <int BITS>
BlockFn kernel(int64_t rows, int64_t tiles) {
  using Rows = std::make_integer_sequence<int, RMAX>;
  static const std::array<std::array<BlockFn, RMAX>, CT> table = {
      row_table<BITS, 1>(Rows{}), row_table<BITS, 2>(Rows{}), row_table<BITS, 3>(Rows{}),
      row_table<BITS, 4>(Rows{})};
  return table[tiles - 1][rows - 1];
}

// Rows begin..end of the tiles t0..t0+n (n <= CT). Few rows: all n tiles at once, so that one
// row has n independent chains; more rows: RMAX rows of two tiles at a time, so that each
// decoded weight vector feeds RMAX multiply-adds. The register budget: 2 * R * C vectors.
template <int BITS>
void block_of(const Problem& p, int64_t begin, int64_t end, int64_t t0, int64_t n) {
  const int64_t rows = end - begin;
  if (rows <= FEW_ROWS) {
    kernel<BITS>(rows, n)(p, begin, t0);
    return;
  }
  for (int64_t t = t0; t < t0 + n; t += 2) {
    const int64_t c = std::min<int64_t>(2, t0 + n - t);
    for (int64_t r = begin; r < end; r += RMAX)
      kernel<BITS>(std::min<int64_t>(RMAX, end - r), c)(p, r, t);
  }
}

// Every tile for every row, on torch's threads. Work items in chunk-major order: a thread's
// consecutive items share a chunk of rows.
template <int BITS>
void run(const Problem& p, int64_t tiles) {
  if (p.M == 0) return;
  const int64_t chunks = (p.M + M_CHUNK - 1) / M_CHUNK;
  const int64_t blocks = (tiles + CT - 1) / CT;
  kvslim_team::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / blocks, t0 = (i % blocks) * CT;
      const int64_t r0 = c * M_CHUNK, r1 = std::min(p.M, r0 + M_CHUNK);
      block_of<BITS>(p, r0, r1, t0, std::min<int64_t>(CT, tiles - t0));
    }
  });
}

at::Tensor group_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& mins, int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "group_mm: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "group_mm: x must be 2-D float32");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "group_mm: qweight must be contiguous uint8 [tiles, bytes]");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == NT && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous(), "group_mm: scales must be contiguous float32 [tiles, groups, 16]");
  TORCH_CHECK((bits == 4) == mins.has_value(), "group_mm: 4-bit weights need mins, 8-bit none");
  const at::Tensor xc = x.contiguous();
  Problem p{};
  p.M = xc.size(0); p.K = xc.size(1); p.N = n;
  p.groups = scales.size(1);
  const int64_t tiles = scales.size(0);
  TORCH_CHECK(p.groups > 0 && p.K % p.groups == 0, "group_mm: ", p.K, " inputs do not split into ",
              p.groups, " groups");
  p.group = p.K / p.groups;
  TORCH_CHECK(bits == 8 || p.group % 2 == 0, "group_mm: 4-bit groups must be even");
  TORCH_CHECK(tiles == (n + NT - 1) / NT && qweight.size(0) == tiles &&
              qweight.size(1) == p.K * NT * bits / 8, "group_mm: weight shape does not match");
  at::Tensor y = at::empty({p.M, n}, xc.options());
  at::Tensor xsum;
  if (bits == 4) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->is_contiguous() &&
                mins->scalar_type() == at::kFloat, "group_mm: mins must match scales");
    xsum = at::empty({p.M, p.groups}, xc.options());
    kvslim_cpu::group_sums(xc.data_ptr<float>(), xsum.data_ptr<float>(), p.M, p.K, p.group);
    p.xsum = xsum.data_ptr<float>();
    p.m = mins->data_ptr<float>();
  }
  p.x = xc.data_ptr<float>();
  p.w = qweight.data_ptr<uint8_t>();
  p.s = scales.data_ptr<float>();
  p.y = y.data_ptr<float>();
  p.tile_bytes = qweight.size(1);
  if (bits == 4) run<4>(p, tiles);
  else run<8>(p, tiles);
  return y;
}

// y = x @ w^T for float32 weights in the same tiles ([tiles][k][16] floats): each output one
// chain of multiply-adds over k in order, whatever the rows.
at::Tensor tiled_mm(const at::Tensor& x, const at::Tensor& weight, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "tiled_mm: x must be 2-D float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous(),
              "tiled_mm: weight must be contiguous float32 [tiles, in * 16]");
  const at::Tensor xc = x.contiguous();
  Problem p{};
  p.M = xc.size(0); p.K = xc.size(1); p.N = n;
  p.groups = 1; p.group = p.K;
  const int64_t tiles = weight.size(0);
  TORCH_CHECK(tiles == (n + NT - 1) / NT && weight.size(1) == p.K * NT,
              "tiled_mm: weight shape does not match");
  at::Tensor y = at::empty({p.M, n}, xc.options());
  p.x = xc.data_ptr<float>();
  p.w = (const uint8_t*)weight.data_ptr<float>();
  p.y = y.data_ptr<float>();
  p.tile_bytes = weight.size(1) * 4;
  run<32>(p, tiles);
  return y;
}

std::string isa() { return kIsa; }

// Each row's sum of x over each of `groups` groups of inputs, in order: what the 4-bit
// offsets multiply (also for group_q8.cpp).
at::Tensor group_sums_op(const at::Tensor& x, int64_t groups) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && groups > 0 &&
                  x.size(1) % groups == 0, "group_sums: x must be float32 [M, K], K a multiple of groups");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), groups}, xc.options());
  kvslim_cpu::group_sums(xc.data_ptr<float>(), out.data_ptr<float>(), xc.size(0), xc.size(1),
             xc.size(1) / groups);
  return out;
}


}  // namespace kvslim_tiled_gemm

TORCH_LIBRARY(kvslim, m) {
  m.def("group_mm(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, int n) -> Tensor");
  m.def("tiled_mm(Tensor x, Tensor weight, int n) -> Tensor");
  m.def("group_sums(Tensor x, int groups) -> Tensor");
  m.def("kernels_isa() -> str", &kvslim_tiled_gemm::isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("group_mm", &kvslim_tiled_gemm::group_mm);
  m.impl("tiled_mm", &kvslim_tiled_gemm::tiled_mm);
  m.impl("group_sums", &kvslim_tiled_gemm::group_sums_op);
}
