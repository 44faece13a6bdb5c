// A Llama-family decoder layer in one native call: the same kernels, in the same order, that
// the layer's Python modules call one by one, so its outputs are their bits; what it removes is
// the Python, the dispatch and the tensors' set-up between them (about 0.4 ms a layer of a
// SmolLM2 decode step against its 0.2 ms of GEMMs: benchmarks/decoder_layer.py).
//
//   h = rms_norm(x) ; qkv = h @ Wqkv ; rope(q, k) ; cache[slots] = k, v
//   x = x + attention(q, cache) @ Wo
//   h = rms_norm(x) ; g, u = h @ Wgu ; x = x + (silu(g) * u) @ Wdown
//
// rms_norm is kvslim's own (below, also the `rms_norm` op RMSNorm runs), RoPE the arithmetic of
// layers/rope.py's apply_rope (x * cos + rotate_half(x) * sin, each product rounded), SiLU and
// the product torch's own ops, the GEMMs group_q8.cpp's (int8 activations), attention
// paged_attention.cpp's, the cache writes store_slots.cpp's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace kvslim_decoder_layer {

// Each row: y = (x * (1 / sqrt(mean(x^2) + eps))) * w, the mean's sum in 8 fixed lanes
// combined in a fixed tree, so a row's bits never depend on the rows beside it.
void rms_norm_rows(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  for (int64_t r = 0; r < M; ++r) {
    const float* v = x + r * H;
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    for (; i + 8 <= H; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += v[i + j] * v[i + j];
    for (int j = 0; i < H; ++i, ++j) part[j] += v[i] * v[i];
    const float sum = ((part[0] + part[4]) + (part[2] + part[6])) +
                      ((part[1] + part[5]) + (part[3] + part[7]));
    const float inv = 1.f / std::sqrt(sum / (float)H + eps);
    float* o = y + r * H;
    for (int64_t k = 0; k < H; ++k) o[k] = (v[k] * inv) * w[k];
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x [..., H] and weight [H] must be float32");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t H = xc.size(-1), M = H ? xc.numel() / H : 0;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    rms_norm_rows(xp + begin * H, wc.data_ptr<float>(), yp + begin * H, end - begin, H, (float)eps);
  });
  return y;
}

// layers/rope.py's apply_rope in place over the first `heads` heads of each row of qkv
// [N, heads_total, D]: x[i] * cos[i] + (-x[i + D/2]) * sin[i] for the first half,
// x[i] * cos[i] + x[i - D/2] * sin[i] for the second; cos, sin [N, D].
void rope_rows(float* qkv, const float* cos, const float* sin, int64_t N, int64_t heads,
               int64_t row_stride, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t n = 0; n < N; ++n) {
    const float* c = cos + n * D;
    const float* s = sin + n * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = qkv + n * row_stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] + (-b) * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

struct Q8Weight {
  at::Tensor qweight, scales;
  std::optional<at::Tensor> mins, colsum;
  int64_t bits, n;
};

Q8Weight weight_of(const std::vector<at::Tensor>& t, const std::vector<std::optional<at::Tensor>>& o,
                   const std::vector<int64_t>& bits, const std::vector<int64_t>& outs, int i) {
  Q8Weight w{t[2 * i], t[2 * i + 1], std::nullopt, std::nullopt, bits[i], outs[i]};
  if (w.bits == 4) w.mins = o[i];
  else w.colsum = o[i];
  return w;
}

at::Tensor mm(const at::Tensor& x, const Q8Weight& w) {
  return kvslim_group_q8::group_mm_q8(x, w.qweight, w.scales, w.mins, w.colsum, w.bits, w.n);
}

// x [N, hidden] -> the layer's output [N, hidden]. weights: qweight and scales of qkv, o,
// gate_up, down in that order; extras: their mins (4-bit) or column sums (8-bit); norms:
// input and post-attention RMSNorm weights. cos, sin [N, D]; the cache, slots and the
// attention's tables as PagedAttention's kernel path passes them.
at::Tensor llama_decoder_layer(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                               const std::vector<std::optional<at::Tensor>>& extras,
                               const std::vector<int64_t>& bits, const std::vector<int64_t>& outs,
                               const at::Tensor& input_norm, const at::Tensor& post_norm,
                               double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
                               const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& slots,
                               const at::Tensor& block_tables, const at::Tensor& context_lens,
                               int64_t key_start, int64_t window, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "llama_decoder_layer: x must be contiguous float32 [N, hidden]");
  TORCH_CHECK(weights.size() == 8 && extras.size() == 4 && bits.size() == 4 && outs.size() == 4,
              "llama_decoder_layer: four weights (qkv, o, gate_up, down)");
  const int64_t N = x.size(0), H = x.size(1), D = head_dim;
  const int64_t width = (heads + 2 * kv_heads) * D, inter = outs[2] / 2;
  TORCH_CHECK(outs[0] == width && outs[1] == H && outs[3] == H && cos.size(-1) == D,
              "llama_decoder_layer: the weights' shapes do not fit the heads");
  const Q8Weight wqkv = weight_of(weights, extras, bits, outs, 0),
                 wo = weight_of(weights, extras, bits, outs, 1),
                 wgu = weight_of(weights, extras, bits, outs, 2),
                 wdown = weight_of(weights, extras, bits, outs, 3);
  const float feps = (float)eps;
  at::Tensor h = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), input_norm.data_ptr<float>(), h.data_ptr<float>(), N, H, feps);
  at::Tensor qkv = mm(h, wqkv);                                        // [N, width]
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  rope_rows(qkv.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), N,
            heads + kv_heads, width, D);
  const at::Tensor heads3 = qkv.view({N, heads + 2 * kv_heads, D});
  const at::Tensor k = heads3.narrow(1, heads, kv_heads), v = heads3.narrow(1, heads + kv_heads, kv_heads);
  kvslim_store_slots::write_slots(k_cache, slots, k);
  kvslim_store_slots::write_slots(v_cache, slots, v);
  const at::Tensor att = kvslim_paged_attention::paged_decode(
      heads3.narrow(1, 0, heads), k_cache, v_cache, std::nullopt, std::nullopt, block_tables,
      context_lens, key_start, window, scale, std::nullopt, std::nullopt);
  at::Tensor y = x + mm(att.view({N, heads * D}), wo);
  rms_norm_rows(y.data_ptr<float>(), post_norm.data_ptr<float>(), h.data_ptr<float>(), N, H, feps);
  const at::Tensor gu = mm(h, wgu);
  const at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
  return y + mm(act, wdown);
}

}  // namespace kvslim_decoder_layer

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("llama_decoder_layer(Tensor x, Tensor[] weights, Tensor?[] extras, int[] bits, "
        "int[] outs, Tensor input_norm, Tensor post_norm, float eps, int heads, int kv_heads, "
        "int head_dim, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor block_tables, Tensor context_lens, int key_start, int window, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("rms_norm", &kvslim_decoder_layer::rms_norm);
  m.impl("llama_decoder_layer", &kvslim_decoder_layer::llama_decoder_layer);
}
