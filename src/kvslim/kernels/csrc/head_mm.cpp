// A matrix product per attention head: out[n, h, :] = x[n, h, :] @ w[h] (w[h] [K, O]), for
// DeepSeek's absorbed latent attention (W_UK folded into the queries, W_UV into the outputs,
// layers/latent_attention.py).
//
// Each output is one chain of multiply-adds over k = 0, 1, ..., K - 1 in order (the loop over
// the O outputs of a row is what vectorizes), so a row's numbers do not depend on how many rows
// share the call; torch's batched GEMM picks other blockings for other row counts.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
#include <torch/library.h>

#include <algorithm>

namespace kvslim_head_mm {

at::Tensor head_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && x.scalar_type() == at::kFloat &&
                  w.scalar_type() == at::kFloat,
              "head_mm: x [N, H, K] and w [H, K, O], float32");
  TORCH_CHECK(x.size(1) == w.size(0) && x.size(2) == w.size(1),
              "head_mm: x's heads and width must be w's [H, K, O]");
  const at::Tensor wc = w.contiguous();
  const int64_t N = x.size(0), H = x.size(1), K = x.size(2), O = wc.size(2);
  const int64_t sn = x.stride(0), sh = x.stride(1), sk = x.stride(2);
  at::Tensor out = at::empty({N, H, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  kvslim_team::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / H, h = item % H;
      const float* xr = xp + n * sn + h * sh;
      const float* wh = wp + h * K * O;
      float* o = op + item * O;
      std::fill(o, o + O, 0.f);
      for (int64_t k = 0; k < K; ++k) {
        const float a = xr[k * sk];
        const float* wr = wh + k * O;
        for (int64_t j = 0; j < O; ++j) o[j] += a * wr[j];
      }
    }
  });
  return out;
}

}  // namespace kvslim_head_mm

TORCH_LIBRARY_FRAGMENT(kvslim, m) { m.def("head_mm(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("head_mm", &kvslim_head_mm::head_mm); }
