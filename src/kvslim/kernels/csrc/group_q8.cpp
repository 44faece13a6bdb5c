// y = x @ w^T for group-quantized weights with the activations quantized to int8 per block of
// 32 inputs, as llama.cpp does (its Q8_0 activations): integer dot products per block with
// AVX-512 VNNI (vpdpbusd: 64 multiply-adds per instruction), then per block one float
// multiply-add with the weight's scale times the activations' scale.
//
//   4-bit: w = q * s + m   (q 0..15)      y += s * dx_b * sum_b(q * xq) + m * sum_g(x)
//   8-bit: w = q * s       (q -128..127)  y += s * dx_b * sum_b(q * xq)
//
// x's block b of 32: dx_b = max|x| / 127, xq = round(x / dx_b) (kernels/tiled_gemm.py's
// `quantize_blocks` says it the same way). The integer sums are exact; the float steps run in
// one fixed order per output, so rows stay bit-identical whatever the batch. m's term uses
// the group's float sum of x, not its quantized one.
//
// Layout ("vnni tiles", kernels/tiled_gemm.py packs it): output columns in tiles of 16; for a
// tile and each run of 8 inputs k..k+7, 64 bytes: byte 4j + t of 4-bit weights holds column
// j's q[k + t] in its low nibble and q[k + 4 + t] in its high one; 8-bit weights take 64 bytes
// per 4 inputs (byte 4j + t: column j's q[k + t] as int8). vpdpbusd multiplies unsigned by
// signed bytes: 4-bit weights are the unsigned side; for 8-bit ones x goes unsigned as
// xq + 128 and the column sums of q (`colsum`, per 32-input block) take 128 * colsum back.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVSLIM_VNNI 1
#endif

namespace {

constexpr int NT = 16;
constexpr int64_t QB = 32;          // activation block

#if KVSLIM_VNNI
constexpr int RMAX = 4;

template <int R, int BITS>
void q8_tile(const int8_t* xq, const float* dx, const float* xsum, const uint8_t* w,
             const float* s, const float* m, const int32_t* colsum, float* y, int64_t K,
             int64_t N, int64_t groups, int64_t t, int64_t r0) {
  const int64_t group = K / groups, blocks = K / QB;
  const int64_t sub = std::min<int64_t>(group, QB);       // inputs per integer sum
  const int64_t tile_bytes = K * NT * BITS / 8;
  const uint8_t* wt = w + t * tile_bytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t k0 = 0; k0 < K; k0 += sub) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    if (BITS == 4) {
      for (int64_t k = k0; k < k0 + sub; k += 8) {
        const __m512i v = _mm512_loadu_si512(wt + k * NT / 2);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = (const int32_t*)(xq + (r0 + r) * K + k);
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(xr[0]));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(xr[1]));
        }
      }
    } else {
      const __m512i bias = _mm512_set1_epi8((char)0x80);
      for (int64_t k = k0; k < k0 + sub; k += 4) {
        const __m512i v = _mm512_loadu_si512(wt + k * NT);
        for (int r = 0; r < R; ++r) {
          const int32_t xr = *(const int32_t*)(xq + (r0 + r) * K + k);
          const __m512i xu = _mm512_xor_si512(_mm512_set1_epi32(xr), bias);   // xq + 128
          isum[r] = _mm512_dpbusd_epi32(isum[r], xu, v);
        }
      }
    }
    const int64_t g = k0 / group, b = k0 / QB;
    const __m512 sv = _mm512_loadu_ps(s + (t * groups + g) * NT);
    __m512i corr = _mm512_setzero_si512();
    if (BITS == 8)
      corr = _mm512_slli_epi32(_mm512_loadu_si512(colsum + (t * (K / sub) + k0 / sub) * NT), 7);
    for (int r = 0; r < R; ++r) {
      const __m512i exact = BITS == 8 ? _mm512_sub_epi32(isum[r], corr) : isum[r];
      const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(dx[(r0 + r) * blocks + b]));
      acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(exact), acc[r]);
    }
    if (BITS == 4 && (k0 + sub) % group == 0) {
      const __m512 mv = _mm512_loadu_ps(m + (t * groups + g) * NT);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[(r0 + r) * groups + g]), acc[r]);
    }
  }
  const int cols = (int)std::min<int64_t>(NT, N - t * NT);
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(y + (r0 + r) * N + t * NT, (__mmask16)((1u << cols) - 1), acc[r]);
}
#endif

}  // namespace

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
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < K / QB; ++b) {
        const float* v = xp + r * K + b * QB;
        float amax = 0.f;
        for (int64_t i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float d = amax / 127.f, inv = d > 0.f ? 127.f / amax : 0.f;
        dp[r * (K / QB) + b] = d;
        for (int64_t i = 0; i < QB; ++i)
          qp[r * K + b * QB + i] = (int8_t)std::nearbyint(v[i] * inv);
      }
  });
  return {xq, dx};
}

at::Tensor group_mm_q8(const at::Tensor& xq, const at::Tensor& dx,
                       const std::optional<at::Tensor>& xsum, const at::Tensor& qweight,
                       const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                       const std::optional<at::Tensor>& colsum, int64_t bits, int64_t n) {
#if KVSLIM_VNNI
  TORCH_CHECK(bits == 4 || bits == 8, "group_mm_q8: bits must be 4 or 8");
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.is_contiguous() && dx.is_contiguous(),
              "group_mm_q8: xq must be contiguous int8 (quantize_blocks)");
  const int64_t M = xq.size(0), K = xq.size(1), groups = scales.size(1), tiles = scales.size(0);
  TORCH_CHECK(K % groups == 0 && (K / groups) % 16 == 0 && K % QB == 0,
              "group_mm_q8: groups must be multiples of 16 inputs");
  TORCH_CHECK(qweight.size(0) == tiles && qweight.size(1) == K * NT * bits / 8 &&
                  tiles == (n + NT - 1) / NT, "group_mm_q8: weight shape does not match");
  TORCH_CHECK((bits == 4) == (mins.has_value() && xsum.has_value()) &&
                  (bits == 8) == colsum.has_value(),
              "group_mm_q8: 4-bit weights take mins and x's group sums, 8-bit ones colsum");
  at::Tensor y = at::empty({M, n}, dx.options());
  const int8_t* xp = xq.data_ptr<int8_t>();
  const float* dp = dx.data_ptr<float>();
  const float* sp = xsum ? xsum->data_ptr<float>() : nullptr;
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* scp = scales.data_ptr<float>();
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  const int32_t* cp = colsum ? colsum->data_ptr<int32_t>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < M;) {
        const int64_t R = std::min<int64_t>(RMAX, M - r);
        auto call = [&](auto fn) { fn(xp, dp, sp, wp, scp, mp, cp, yp, K, n, groups, t, r); };
        if (bits == 4) {
          if (R == 4) call(q8_tile<4, 4>); else if (R == 3) call(q8_tile<3, 4>);
          else if (R == 2) call(q8_tile<2, 4>); else call(q8_tile<1, 4>);
        } else {
          if (R == 4) call(q8_tile<4, 8>); else if (R == 3) call(q8_tile<3, 8>);
          else if (R == 2) call(q8_tile<2, 8>); else call(q8_tile<1, 8>);
        }
        r += R;
      }
  });
  return y;
#else
  TORCH_CHECK(false, "group_mm_q8: this build has no AVX-512 VNNI");
#endif
}

bool has_vnni() {
#if KVSLIM_VNNI
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("quantize_blocks(Tensor x) -> (Tensor, Tensor)");
  m.def("group_mm_q8(Tensor xq, Tensor dx, Tensor? xsum, Tensor qweight, Tensor scales, "
        "Tensor? mins, Tensor? colsum, int bits, int n) -> Tensor");
  m.def("has_vnni() -> bool", &has_vnni);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("quantize_blocks", &quantize_blocks);
  m.impl("group_mm_q8", &group_mm_q8);
}
