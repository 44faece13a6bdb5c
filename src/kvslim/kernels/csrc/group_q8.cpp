// y = x @ w^T for group-quantized weights with the activations quantized to int8 per block of
// 32 inputs, as llama.cpp does (its Q8_0 activations): integer dot products per block with
// AVX-512 VNNI (vpdpbusd: 64 multiply-adds per instruction), then per block one float
// multiply-add with the weight's scale times the activations' scale.
//
//   4-bit: w = q * s + m   (q 0..15)      y += s * dx_b * sum_b(q * xq) + m * sum_g(dx_b * xq)
//   4-bit without m: w = (q - 8) * s      y += s * dx_b * (sum_b(q * xq) - 8 * sum_b(xq))
//   8-bit: w = q * s       (q -128..127)  y += s * dx_b * sum_b(q * xq)
//
// The second is llama.cpp's Q4_0 (and GPTQ's symmetric 4-bit): its offset is -8 * s, so it needs
// no offsets in the stream (18 bytes per 32 weights with float16 scales, not 20) and no float
// step for them; the integer block sums of xq (`isums`) correct the dot product exactly.
//
// x's block b of 32: dx_b = max|x| / 127, xq = round(x / dx_b) (kernels/tiled_gemm.py's
// `quantize_blocks` says it the same way). The integer sums are exact; the float steps run in
// one fixed order per output, so rows stay bit-identical whatever the batch. m's term uses
// the group's sum of x as quantized, as llama.cpp's Q8_1 blocks do (quantized_group_sums).
//
// W8A8 (row_mm_q8): x quantized per row instead (one scale per token, quantize_rows), int8
// weights with one scale per output: the integer sum runs over all K and one float step
// rescales it, y = (sum(q * xq) * dx) * s, the bits of torch._int_mm's product rescaled so.
//
// Layout ("vnni tiles", kernels/tiled_gemm.py packs it): output columns in tiles of 16; for a
// tile and each run of 8 inputs k..k+7, 64 bytes: byte 4j + t of 4-bit weights holds column
// j's q[k + t] in its low nibble and q[k + 4 + t] in its high one; 8-bit weights take 64 bytes
// per 4 inputs (byte 4j + t: column j's q[k + t] as int8). vpdpbusd multiplies unsigned by
// signed bytes: 4-bit weights are the unsigned side; for 8-bit ones x goes unsigned as
// xq + 128 and the column sums of q (`colsum`, per 32-input block) take 128 * colsum back.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

// Three builds of the integer dot products, all exact, all with the float steps below in the
// same order per output, so they give the same bits: AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw
// then vpmaddwd, as llama.cpp runs its Q8 dots on AVX2: 4-bit weights as the unsigned side;
// 8-bit ones as |q| against x with q's sign, so no pair of products passes int16's range) and
// scalar C++.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVSLIM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSLIM_Q8_AVX2 1
#endif

namespace kvslim_group_q8 {

constexpr int NT = 16;
constexpr int64_t QB = 32;          // activation block

// Scales and offsets are float32, or float16 where every one of them is a float16 exactly
// (GGUF stores them so: group_q8.py packs them at their own width, a sixth fewer bytes in a
// 4-bit step's stream). float16 -> float32 is exact, so both give the same bits.
inline float scalar_of(const float* p) { return *p; }
inline float scalar_of(const c10::Half* p) { return (float)*p; }

#if KVSLIM_VNNI
const char* kQ8Isa = "avx512_vnni";
constexpr int RMAX = 4;           // rows per call when they are many (one tile at a time)
constexpr int FEW_ROWS = 1;       // up to this many rows, CT tiles side by side
constexpr int CT = 4;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// Rows r0..r0+R of tiles t0..t0+C. C tiles side by side give one row C independent chains of
// vpdpbusd (one chain is bound by its latency); lo and hi nibbles sum into separate integer
// accumulators, added before the float step. Integer sums are exact, so neither split changes
// a bit of any output: the float steps stay one fixed sequence per output.
template <int R, int C, int BITS, bool ROW, typename S>
void q8_block(const int8_t* xq, const float* dx, const float* xsum, const uint8_t* w,
              const S* s, const S* m, const int32_t* isums, float* y, int64_t K,
              int64_t N, int64_t groups, int64_t t0, int64_t r0) {
  // ROW: one activation scale per row (dx [M, 1]) and one weight scale per output, so the
  // integer sum runs over all K and the float step is (sum * dx) * s, as
  // quantization/kernels.py's w8a8_linear rescales torch._int_mm's product.
  const int64_t group = K / groups, blocks = ROW ? 1 : K / QB;
  const int64_t sub = ROW ? K : std::min<int64_t>(group, QB);       // inputs per integer sum
  const int64_t tile_bytes = K * NT * BITS / 8;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  for (int64_t k0 = 0; k0 < K; k0 += sub) {
    __m512i isum[R][C], isum2[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) isum[r][c] = isum2[r][c] = _mm512_setzero_si512();
    if (BITS == 4) {
      for (int64_t k = k0; k < k0 + sub; k += 8)
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_loadu_si512(w + (t0 + c) * tile_bytes + k * NT / 2);
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int32_t* xr = (const int32_t*)(xq + (r0 + r) * K + k);
            isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], lo, _mm512_set1_epi32(xr[0]));
            isum2[r][c] = _mm512_dpbusd_epi32(isum2[r][c], hi, _mm512_set1_epi32(xr[1]));
          }
        }
    } else {
      for (int64_t k = k0; k < k0 + sub; k += 8)
        for (int c = 0; c < C; ++c) {
          const uint8_t* wk = w + (t0 + c) * tile_bytes + k * NT;
          const __m512i v0 = _mm512_loadu_si512(wk), v1 = _mm512_loadu_si512(wk + 4 * NT);
          for (int r = 0; r < R; ++r) {
            const int32_t* xr = (const int32_t*)(xq + (r0 + r) * K + k);
            const __m512i x0 = _mm512_xor_si512(_mm512_set1_epi32(xr[0]), bias);   // xq + 128
            const __m512i x1 = _mm512_xor_si512(_mm512_set1_epi32(xr[1]), bias);
            isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], x0, v0);
            isum2[r][c] = _mm512_dpbusd_epi32(isum2[r][c], x1, v1);
          }
        }
    }
    const int64_t g = k0 / group, b = ROW ? 0 : k0 / QB;
    for (int c = 0; c < C; ++c) {
      const int64_t t = t0 + c;
      const __m512 sv = load16(s + (t * groups + g) * NT);
      __m512i corr = _mm512_setzero_si512();
      if (BITS == 8)
        corr = _mm512_slli_epi32(_mm512_loadu_si512(isums + (t * (K / sub) + k0 / sub) * NT), 7);
      for (int r = 0; r < R; ++r) {
        __m512i exact = _mm512_add_epi32(isum[r][c], isum2[r][c]);
        if (BITS == 8) exact = _mm512_sub_epi32(exact, corr);
        else if (!m) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(8 * isums[(r0 + r) * blocks + b]));
        const __m512 dxv = _mm512_set1_ps(dx[(r0 + r) * blocks + b]);
        if (ROW)
          acc[r][c] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), dxv), sv);
        else
          acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(sv, dxv), _mm512_cvtepi32_ps(exact), acc[r][c]);
      }
      if (BITS == 4 && m && (k0 + sub) % group == 0) {
        const __m512 mv = load16(m + (t * groups + g) * NT);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[(r0 + r) * groups + g]), acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int cols = (int)std::min<int64_t>(NT, N - (t0 + c) * NT);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(y + (r0 + r) * N + (t0 + c) * NT, (__mmask16)((1u << cols) - 1),
                            acc[r][c]);
  }
}

#elif KVSLIM_Q8_AVX2
const char* kQ8Isa = "avx2";
// One row streams each weight from memory once and the hardware's prefetcher alone keeps too
// few lines in flight: each loop asks for the bytes PREFETCH ahead of its tile, the next
// tiles'. SmolLM2's Q4_1 layers (80 MB read once per step, M = 1, a shared 2-core EPYC, one
// run each): 12.8 GB/s without, 19.7 / 22.9 / 22.1 GB/s at 2, 8 and 16 KiB;
// benchmarks/decode_gemm_stream.py times the same read (q8 at M = 1).
constexpr int64_t PREFETCH = 8192;
constexpr int RMAX = 2;           // 16 ymm registers: 2 rows x 2 halves of float and int sums
constexpr int FEW_ROWS = 1;
constexpr int CT = 2;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  alignas(32) float f[8];
  for (int j = 0; j < 8; ++j) f[j] = (float)p[j];
  return _mm256_load_ps(f);
#endif
}

// A 16-column tile as two halves of 8 columns (bytes 32h..32h+31 of each 64-byte run): lane
// j of a half's int32 sums is column 8h + j, as the VNNI kernel's lane 8h + j.
template <int R, int C, int BITS, bool ROW, typename S>
void q8_block(const int8_t* xq, const float* dx, const float* xsum, const uint8_t* w,
              const S* s, const S* m, const int32_t* isums, float* y, int64_t K, int64_t N,
              int64_t groups, int64_t t0, int64_t r0) {
  const int64_t group = K / groups, blocks = ROW ? 1 : K / QB;
  const int64_t sub = ROW ? K : std::min<int64_t>(group, QB);
  const int64_t tile_bytes = K * NT * BITS / 8;
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t k0 = 0; k0 < K; k0 += sub) {
    __m256i isum[R][C][2];
    if (BITS == 4) {
      // int16 sums over at most 32 inputs: 4 runs of 8, each pair of products <= 2 * 15 * 127,
      // so a lane holds at most 4 * 2 * 3810 = 30480 and never saturates.
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c][0] = isum[r][c][1] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + sub; k += 8)
        for (int c = 0; c < C; ++c)
          for (int h = 0; h < 2; ++h) {
            if (R == 1 && h == 0)
              _mm_prefetch((const char*)(w + (t0 + c) * tile_bytes + k * NT / 2 + PREFETCH),
                           _MM_HINT_T0);
            const __m256i v = _mm256_loadu_si256(
                (const __m256i*)(w + (t0 + c) * tile_bytes + k * NT / 2 + 32 * h));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < R; ++r) {
              const int32_t* xr = (const int32_t*)(xq + (r0 + r) * K + k);
              const __m256i p = _mm256_add_epi16(
                  _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[0])),
                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[1])));
              isum[r][c][h] = _mm256_add_epi16(isum[r][c][h], p);
            }
          }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          for (int h = 0; h < 2; ++h) isum[r][c][h] = _mm256_madd_epi16(isum[r][c][h], ones);
    } else {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c][0] = isum[r][c][1] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + sub; k += 4)
        for (int c = 0; c < C; ++c)
          for (int h = 0; h < 2; ++h) {
            if (R == 1 && h == 0)
              _mm_prefetch((const char*)(w + (t0 + c) * tile_bytes + k * NT + PREFETCH),
                           _MM_HINT_T0);
            const __m256i v = _mm256_loadu_si256(
                (const __m256i*)(w + (t0 + c) * tile_bytes + k * NT + 32 * h));
            const __m256i a = _mm256_sign_epi8(v, v);                 // |q| (128 for -128)
            for (int r = 0; r < R; ++r) {
              const int32_t* xr = (const int32_t*)(xq + (r0 + r) * K + k);
              const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xr[0]), v);
              isum[r][c][h] = _mm256_add_epi32(
                  isum[r][c][h], _mm256_madd_epi16(_mm256_maddubs_epi16(a, xs), ones));
            }
          }
    }
    const int64_t g = k0 / group, b = ROW ? 0 : k0 / QB;
    for (int c = 0; c < C; ++c) {
      const int64_t t = t0 + c;
      for (int h = 0; h < 2; ++h) {
        const __m256 sv = load8(s + (t * groups + g) * NT + 8 * h);
        for (int r = 0; r < R; ++r) {
          const __m256 dxv = _mm256_set1_ps(dx[(r0 + r) * blocks + b]);
          const __m256 exact = _mm256_cvtepi32_ps(
              BITS == 4 && !m ? _mm256_sub_epi32(isum[r][c][h],
                                                 _mm256_set1_epi32(8 * isums[(r0 + r) * blocks + b]))
                              : isum[r][c][h]);
          if (ROW)
            acc[r][c][h] = _mm256_mul_ps(_mm256_mul_ps(exact, dxv), sv);
          else
            acc[r][c][h] = _mm256_fmadd_ps(_mm256_mul_ps(sv, dxv), exact, acc[r][c][h]);
        }
        if (BITS == 4 && m && (k0 + sub) % group == 0) {
          const __m256 mv = load8(m + (t * groups + g) * NT + 8 * h);
          for (int r = 0; r < R; ++r)
            acc[r][c][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[(r0 + r) * groups + g]),
                                           acc[r][c][h]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t cols = std::min<int64_t>(NT, N - (t0 + c) * NT);
    for (int r = 0; r < R; ++r) {
      float* out = y + (r0 + r) * N + (t0 + c) * NT;
      if (cols == NT) {
        _mm256_storeu_ps(out, acc[r][c][0]);
        _mm256_storeu_ps(out + 8, acc[r][c][1]);
      } else {
        alignas(32) float tmp[NT];
        _mm256_store_ps(tmp, acc[r][c][0]);
        _mm256_store_ps(tmp + 8, acc[r][c][1]);
        for (int64_t j = 0; j < cols; ++j) out[j] = tmp[j];
      }
    }
  }
}

#else
const char* kQ8Isa = "scalar";
constexpr int RMAX = 4;
constexpr int FEW_ROWS = 1;
constexpr int CT = 1;

// The same integer sums and float steps per output, one column at a time.
template <int R, int C, int BITS, bool ROW, typename S>
void q8_block(const int8_t* xq, const float* dx, const float* xsum, const uint8_t* w,
              const S* s, const S* m, const int32_t* isums, float* y, int64_t K, int64_t N,
              int64_t groups, int64_t t0, int64_t r0) {
  const int64_t group = K / groups, blocks = ROW ? 1 : K / QB;
  const int64_t sub = ROW ? K : std::min<int64_t>(group, QB);
  const int64_t tile_bytes = K * NT * BITS / 8;
  for (int c = 0; c < C; ++c) {
    const int64_t t = t0 + c, cols = std::min<int64_t>(NT, N - t * NT);
    const uint8_t* wt = w + t * tile_bytes;
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + (r0 + r) * K;
      for (int64_t j = 0; j < cols; ++j) {
        float acc = 0.f;
        for (int64_t k0 = 0; k0 < K; k0 += sub) {
          int32_t exact = 0;
          for (int64_t k = k0; k < k0 + sub; ++k) {
            int32_t q;
            if (BITS == 4) {
              const uint8_t byte = wt[(k / 8) * 8 * NT / 2 + 4 * j + (k % 4)];
              q = (k % 8) < 4 ? (byte & 15) : (byte >> 4);
            } else {
              q = (int8_t)wt[(k / 4) * 4 * NT + 4 * j + (k % 4)];
            }
            exact += q * (int32_t)x[k];
          }
          const int64_t g = k0 / group, b = ROW ? 0 : k0 / QB;
          if (BITS == 4 && !m) exact -= 8 * isums[(r0 + r) * blocks + b];
          const float sv = scalar_of(s + (t * groups + g) * NT + j);
          const float d = dx[(r0 + r) * blocks + b];
          if (ROW) acc = ((float)exact * d) * sv;
          else acc = std::fma(sv * d, (float)exact, acc);
          if (BITS == 4 && m && (k0 + sub) % group == 0)
            acc = std::fma(scalar_of(m + (t * groups + g) * NT + j), xsum[(r0 + r) * groups + g],
                           acc);
        }
        y[(r0 + r) * N + t * NT + j] = acc;
      }
    }
  }
}
#endif

template <typename S>
using Q8Fn = decltype(&q8_block<1, 1, 4, false, S>);

template <int BITS, bool ROW, typename S>
Q8Fn<S> q8_kernel(int64_t rows, int64_t tiles) {
  static_assert(FEW_ROWS == 1 && CT <= 4 && RMAX <= 4, "the tables below hold these sizes");
  static const Q8Fn<S> few[4] = {
      q8_block<1, 1, BITS, ROW, S>, q8_block<1, std::min(2, CT), BITS, ROW, S>,
      q8_block<1, std::min(3, CT), BITS, ROW, S>, q8_block<1, std::min(4, CT), BITS, ROW, S>};
  static const Q8Fn<S> many[4] = {
      q8_block<1, 1, BITS, ROW, S>, q8_block<std::min(2, RMAX), 1, BITS, ROW, S>,
      q8_block<std::min(3, RMAX), 1, BITS, ROW, S>, q8_block<std::min(4, RMAX), 1, BITS, ROW, S>};
  return tiles > 1 ? few[tiles - 1] : many[rows - 1];
}

// Few rows: work items of CT tiles, all rows at once; more rows: one tile per item, RMAX
// rows per call. Which call computes a row changes nothing in its arithmetic. cp: 8-bit
// weights' column sums, or x's block sums for 4-bit weights without offsets.
template <typename S>
void run_tiles_of(const int8_t* xp, const float* dp, const float* sp, const uint8_t* wp,
                  const S* scp, const S* mp, const int32_t* cp, float* yp, int64_t M, int64_t K,
                  int64_t n, int64_t groups, int64_t tiles, int64_t bits, bool row) {
  const bool few = M <= FEW_ROWS;
  const int64_t per_item = few ? CT : 1, items = (tiles + per_item - 1) / per_item;
  kvslim_team::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t0 = i * per_item, c = std::min<int64_t>(per_item, tiles - t0);
      for (int64_t r = 0; r < M;) {
        const int64_t R = few ? M : std::min<int64_t>(RMAX, M - r);
        const Q8Fn<S> fn = row ? q8_kernel<8, true, S>(R, c)
                               : bits == 4 ? q8_kernel<4, false, S>(R, c)
                                           : q8_kernel<8, false, S>(R, c);
        fn(xp, dp, sp, wp, scp, mp, cp, yp, K, n, groups, t0, r);
        r += R;
      }
    }
  });
}

at::Tensor run_tiles(const int8_t* xp, const float* dp, const float* sp, const at::Tensor& qweight,
                     const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                     const int32_t* cp, int64_t M, int64_t K, int64_t n, int64_t bits, bool row) {
  const int64_t groups = scales.size(1), tiles = scales.size(0);
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) &&
                  (!mins || mins->scalar_type() == scales.scalar_type()),
              "group_q8: scales (and mins) must be float32 or float16, both the same");
  at::Tensor y = at::empty({M, n}, scales.options().dtype(at::kFloat));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (half)
    run_tiles_of<c10::Half>(xp, dp, sp, wp, scales.data_ptr<c10::Half>(),
                            mins ? mins->data_ptr<c10::Half>() : nullptr, cp, yp, M, K, n,
                            groups, tiles, bits, row);
  else
    run_tiles_of<float>(xp, dp, sp, wp, scales.data_ptr<float>(),
                        mins ? mins->data_ptr<float>() : nullptr, cp, yp, M, K, n, groups,
                        tiles, bits, row);
  return y;
}


// x's int8 blocks: xq [M, K] and dx [M, K / 32], each row in one fixed order.
std::tuple<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % QB == 0,
              "quantize_blocks: x must be float32 [M, K] with K a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor xq = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, K / QB}, xc.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  kvslim_team::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < K / QB; ++b) {
        const float* v = xp + r * K + b * QB;
        int8_t* q = qp + r * K + b * QB;
#if KVSLIM_VNNI
        // The same steps in vectors: max is exact in any order, and cvtps rounds to nearest
        // even, as nearbyint does.
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.f, inv = d > 0.f ? 127.f / amax : 0.f;
        const __m512 iv = _mm512_set1_ps(inv);
        _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, iv))));
        _mm_storeu_si128((__m128i*)(q + 16),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, iv))));
#else
        float amax = 0.f;
        for (int64_t i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float d = amax / 127.f, inv = d > 0.f ? 127.f / amax : 0.f;
        for (int64_t i = 0; i < QB; ++i) q[i] = (int8_t)std::nearbyint(v[i] * inv);
#endif
        dp[r * (K / QB) + b] = d;
      }
  });
  return {xq, dx};
}

// Each row's sum over each group of the activations as quantized, sum_g(dx_b * xq): what the
// 4-bit offsets m multiply. llama.cpp's Q8_1 blocks carry the same sum, so that m's term and the
// integer term multiply one vector, x as rounded: w . x~ = sum(s * q * x~) + m * sum(x~), whose
// error sum(w * (x~ - x)) has the centred weights' size. With x's own sum the offsets would add
// m * sum(x~ - x) (measured: SmolLM2's Q4_1 perplexity +2.0% against float32 activations, not
// +0.6%; benchmarks/activation_ppl.py). Integer sums per block inside the group, then one float
// step per block in order.
void quantized_group_sums(const int8_t* xq, const float* dx, float* out, int64_t M, int64_t K,
                          int64_t group) {
  const int64_t groups = K / group, blocks = K / QB;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float acc = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group;) {
        const int64_t b = k / QB, end = std::min((b + 1) * QB, (g + 1) * group);
        int32_t isum = 0;
        for (; k < end; ++k) isum += xq[r * K + k];
        acc += dx[r * blocks + b] * (float)isum;
      }
      out[r * groups + g] = acc;
    }
}

// Each row's integer sum of xq over each block of 32: what a 4-bit weight without offsets
// (w = (q - 8) * s) takes 8 times from its integer dot product, block by block.
at::Tensor block_sums(const at::Tensor& xq) {
  const int64_t M = xq.size(0), blocks = xq.size(1) / QB;
  at::Tensor out = at::empty({M, blocks}, xq.options().dtype(at::kInt));
  const int8_t* q = xq.data_ptr<int8_t>();
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t i = 0; i < M * blocks; ++i) {
    int32_t sum = 0;
    for (int64_t k = 0; k < QB; ++k) sum += q[i * QB + k];
    o[i] = sum;
  }
  return out;
}

// One call from float x: its blocks quantized, its group sums, then the integer dot products.
at::Tensor group_mm_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins,
                       const std::optional<at::Tensor>& colsum, int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "group_mm_q8: bits must be 4 or 8");
  const int64_t groups = scales.size(1), tiles = scales.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "group_mm_q8: x must be 2-D float32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % groups == 0 && (K / groups) % 16 == 0 && K % QB == 0,
              "group_mm_q8: groups must be multiples of 16 inputs");
  TORCH_CHECK(qweight.size(0) == tiles && qweight.size(1) == K * NT * bits / 8 &&
                  tiles == (n + NT - 1) / NT, "group_mm_q8: weight shape does not match");
  TORCH_CHECK((bits == 8) == colsum.has_value() && (bits == 4 || !mins.has_value()),
              "group_mm_q8: 8-bit weights take colsum, 4-bit ones (optional) mins");
  TORCH_CHECK(bits == 8 || mins.has_value() || (K / groups) % QB == 0,
              "group_mm_q8: 4-bit weights without mins need groups of a multiple of 32");
  const at::Tensor xc = x.contiguous();
  auto [xq, dx] = quantize_blocks(xc);
  std::optional<at::Tensor> xsum, isums = colsum;
  if (bits == 4 && mins) {
    xsum = at::empty({M, groups}, xc.options());
    quantized_group_sums(xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xsum->data_ptr<float>(),
                         M, K, K / groups);
  } else if (bits == 4) {
    isums = block_sums(xq);
  }
  return run_tiles(xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                   xsum ? xsum->data_ptr<float>() : nullptr, qweight, scales, mins,
                   isums ? isums->data_ptr<int32_t>() : nullptr, M, K, n, bits, false);
}

// x's int8 rows with one scale each, quantization/kernels.py's quantize_per_token step for step:
// sx = max(amax / 127, FLT_MIN), xq = clamp(round(x / sx), -127, 127) (amax [M, 1] given
// when the row is wider than x: a tensor-parallel shard). A division, as torch's, not a
// multiplication by 127 / amax, so the codes are the same bits.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x,
                                                  const std::optional<at::Tensor>& amax) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 16 == 0,
              "quantize_rows: x must be float32 [M, K] with K a multiple of 16");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor xq = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor sx = amax ? amax->to(at::kFloat).reshape({M, 1}).clone() : at::empty({M, 1}, xc.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = sx.data_ptr<float>();
  const bool given = amax.has_value();
  kvslim_team::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = xp + r * K;
      int8_t* q = qp + r * K;
      float m = 0.f;
      if (given) m = sp[r];
      else for (int64_t i = 0; i < K; ++i) m = std::max(m, std::fabs(v[i]));
      const float d = std::max(m / 127.f, std::numeric_limits<float>::min());
      sp[r] = d;
#if KVSLIM_VNNI
      const __m512 dv = _mm512_set1_ps(d), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      for (int64_t i = 0; i < K; i += 16) {
        const __m512 c = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(v + i), dv), lo), hi);
        _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
      }
#else
      for (int64_t i = 0; i < K; ++i)
        q[i] = (int8_t)std::nearbyint(std::min(std::max(v[i] / d, -127.f), 127.f));
#endif
    }
  });
  return {xq, sx};
}

// W8A8: x quantized per row (quantize_rows), int8 weights with one scale per output
// (scales [tiles, 1, 16]), colsum [tiles, 1, 16] each output's sum of q over all K.
at::Tensor row_mm_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& colsum, const std::optional<at::Tensor>& amax, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % QB == 0,
              "row_mm_q8: x must be float32 [M, K] with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), tiles = scales.size(0);
  TORCH_CHECK(scales.size(1) == 1 && colsum.size(1) == 1 && qweight.size(0) == tiles &&
                  qweight.size(1) == K * NT && tiles == (n + NT - 1) / NT,
              "row_mm_q8: weight shape does not match");
  auto [xq, sx] = quantize_rows(x, amax);
  return run_tiles(xq.data_ptr<int8_t>(), sx.data_ptr<float>(), nullptr, qweight, scales,
                   std::nullopt, colsum.data_ptr<int32_t>(), M, K, n, 8, true);
}

// Which integer dot products this build runs: avx512_vnni, avx2 or scalar.
std::string q8_isa() { return kQ8Isa; }

}  // namespace kvslim_group_q8

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("quantize_blocks(Tensor x) -> (Tensor, Tensor)");
  m.def("group_mm_q8(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? colsum, "
        "int bits, int n) -> Tensor");
  m.def("quantize_rows(Tensor x, Tensor? amax) -> (Tensor, Tensor)");
  m.def("row_mm_q8(Tensor x, Tensor qweight, Tensor scales, Tensor colsum, Tensor? amax, int n) "
        "-> Tensor");
  m.def("q8_isa() -> str", &kvslim_group_q8::q8_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("quantize_blocks", &kvslim_group_q8::quantize_blocks);
  m.impl("group_mm_q8", &kvslim_group_q8::group_mm_q8);
  m.impl("quantize_rows", &kvslim_group_q8::quantize_rows);
  m.impl("row_mm_q8", &kvslim_group_q8::row_mm_q8);
}
