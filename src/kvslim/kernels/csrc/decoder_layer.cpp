// A decoder layer (Llama family, Qwen3, Gemma 3), or all of a step's layers, in one native
// call: the same kernels, in the same order, that the layer's Python modules call one by one, so
// its outputs are their bits; what it removes is the Python, the dispatch and the tensors'
// set-up between them, and with the whole stack in one call the threads' wake-ups between
// layers (benchmarks/decoder_layer.py measures all three ways).
//
// rms_norm is kvslim's own (below, also the `rms_norm` op RMSNorm and GemmaRMSNorm run), RoPE
// the arithmetic of layers/rope.py's apply_rope (x * cos + rotate_half(x) * sin, each product
// rounded), the activations and the product torch's own ops, the GEMMs group_q8.cpp's (int8 activations), attention
// paged_attention.cpp's, the cache writes store_slots.cpp's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "thread_team.h"
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
  kvslim_team::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
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

// Each of `rows` rows of width D normalised in place (rms_norm_rows reads a row's element
// before it writes it): the per-head q and k norms of Qwen3 and Gemma 3.
void rms_norm_heads(float* qkv, const float* w, int64_t N, int64_t row_stride, int64_t first,
                    int64_t rows, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n)
    rms_norm_rows(qkv + n * row_stride + first * D, w, qkv + n * row_stride + first * D, rows, D,
                  eps);
}

float* data(const std::optional<at::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; }

// What a layer is besides its inputs. norms (RMSNorm weights as the kernel multiplies them:
// Gemma's 1 + w): before attention, on attention's output (Gemma), before the MLP, on the MLP's
// output (Gemma), of each query head and each key head (Qwen3, Gemma) — all but the first and
// third optional. act: the gate's activation, 0 SiLU, 1 tanh-approximated GELU.
enum Norm { PRE_ATTN, ATTN_OUT, PRE_MLP, MLP_OUT, Q_HEAD, K_HEAD, NORMS };

// LoRA adapters beside the four linears (lora/layer.py's LoRALinear, the same kernel and the
// same order: each linear's output, then its adapters' B(A x) added, before any norm): per
// linear its slots' A and B, the step's slot of every row, and each linear's output shards
// (qkv: 3, o: 1, gate_up: 2, down: 1 numbers, in that order). No slots: no adapters.
struct Adapters {
  const std::optional<at::Tensor>& slots;
  std::vector<at::Tensor> ab;                  // a, b of qkv, o, gate_up, down
  std::vector<int64_t> shards;                 // 7 output-row counts

  void add(const at::Tensor& y, const at::Tensor& x, int linear) const {
    if (!slots) return;
    static const int first[5] = {0, 3, 4, 6, 7};
    const std::vector<int64_t> rows(shards.begin() + first[linear],
                                    shards.begin() + first[linear + 1]);
    kvslim_lora_sgmv::lora_add_(y, x, *slots, ab[2 * linear], ab[2 * linear + 1], rows);
  }
};

Adapters adapters_of(const std::optional<at::Tensor>& slots, const std::vector<at::Tensor>& ab,
                     const std::vector<int64_t>& shards) {
  TORCH_CHECK(!slots || (ab.size() == 8 && shards.size() == 7),
              "decoder_layer: adapters take 8 tensors (A, B of qkv, o, gate_up, down) and 7 "
              "shard row counts");
  return Adapters{slots, ab, shards};
}

// x [N, hidden] -> the layer's output [N, hidden]. weights: qweight and scales of qkv, o,
// gate_up, down in that order; extras: their mins (4-bit) or column sums (8-bit). cos, sin
// [N, D]; the cache, slots and the attention's tables as PagedAttention's kernel path passes
// them.
//
//   h = norm(x) ; qkv = h @ Wqkv ; q, k = head_norm(q, k) ; rope(q, k) ; cache[slots] = k, v
//   x = x + out_norm(attention(q, cache) @ Wo)
//   h = norm(x) ; g, u = h @ Wgu ; x = x + out_norm((act(g) * u) @ Wdown)
at::Tensor run_layer(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                     const std::vector<std::optional<at::Tensor>>& extras,
                     const std::vector<int64_t>& bits, const std::vector<int64_t>& outs,
                     const std::vector<std::optional<at::Tensor>>& norms, double eps,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t act,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, int64_t key_start, int64_t window,
                     double scale, const Adapters& lora,
                     const std::optional<at::Tensor>& demoted_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decoder_layer: x must be contiguous float32 [N, hidden]");
  TORCH_CHECK(weights.size() == 8 && extras.size() == 4 && bits.size() == 4 && outs.size() == 4 &&
                  norms.size() == NORMS && norms[PRE_ATTN] && norms[PRE_MLP] && act >= 0 && act <= 1,
              "decoder_layer: four weights (qkv, o, gate_up, down), six norms, act 0 or 1");
  const int64_t N = x.size(0), H = x.size(1), D = head_dim;
  const int64_t width = (heads + 2 * kv_heads) * D, inter = outs[2] / 2;
  TORCH_CHECK(outs[0] == width && outs[1] == H && outs[3] == H && cos.size(-1) == D,
              "decoder_layer: the weights' shapes do not fit the heads");
  const Q8Weight wqkv = weight_of(weights, extras, bits, outs, 0),
                 wo = weight_of(weights, extras, bits, outs, 1),
                 wgu = weight_of(weights, extras, bits, outs, 2),
                 wdown = weight_of(weights, extras, bits, outs, 3);
  const float feps = (float)eps;
  at::Tensor h = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), data(norms[PRE_ATTN]), h.data_ptr<float>(), N, H, feps);
  at::Tensor qkv = mm(h, wqkv);                                        // [N, width]
  lora.add(qkv, h, 0);
  if (norms[Q_HEAD]) rms_norm_heads(qkv.data_ptr<float>(), data(norms[Q_HEAD]), N, width, 0, heads, D, feps);
  if (norms[K_HEAD]) rms_norm_heads(qkv.data_ptr<float>(), data(norms[K_HEAD]), N, width, heads, kv_heads, D, feps);
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  rope_rows(qkv.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), N,
            heads + kv_heads, width, D);
  const at::Tensor heads3 = qkv.view({N, heads + 2 * kv_heads, D});
  const at::Tensor k = heads3.narrow(1, heads, kv_heads), v = heads3.narrow(1, heads + kv_heads, kv_heads);
  kvslim_store_slots::write_slots(k_cache, slots, k);
  kvslim_store_slots::write_slots(v_cache, slots, v);
  const at::Tensor att = kvslim_paged_attention::paged_decode(
      heads3.narrow(1, 0, heads), k_cache, v_cache, std::nullopt, std::nullopt, block_tables,
      context_lens, key_start, window, scale, std::nullopt, std::nullopt, 0, demoted_scales);
  const at::Tensor att_rows = att.view({N, heads * D});
  at::Tensor a = mm(att_rows, wo);
  lora.add(a, att_rows, 1);
  if (norms[ATTN_OUT]) rms_norm_rows(a.data_ptr<float>(), data(norms[ATTN_OUT]), a.data_ptr<float>(), N, H, feps);
  at::Tensor y = x + a;
  rms_norm_rows(y.data_ptr<float>(), data(norms[PRE_MLP]), h.data_ptr<float>(), N, H, feps);
  const at::Tensor gu = mm(h, wgu);
  lora.add(gu, h, 2);
  const at::Tensor gate = gu.narrow(1, 0, inter);
  const at::Tensor gated = (act == 0 ? at::silu(gate) : at::gelu(gate, "tanh")) *
                           gu.narrow(1, inter, inter);
  at::Tensor m = mm(gated, wdown);
  lora.add(m, gated, 3);
  if (norms[MLP_OUT]) rms_norm_rows(m.data_ptr<float>(), data(norms[MLP_OUT]), m.data_ptr<float>(), N, H, feps);
  return y + m;
}

// One layer, with torch's threads held for its whole length (thread_team.h): one wake-up a
// layer, not one a kernel.
at::Tensor decoder_layer(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<std::optional<at::Tensor>>& extras,
                         const std::vector<int64_t>& bits, const std::vector<int64_t>& outs,
                         const std::vector<std::optional<at::Tensor>>& norms, double eps,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t act,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t key_start, int64_t window, double scale,
                         const std::optional<at::Tensor>& lora_slots,
                         const std::vector<at::Tensor>& lora, const std::vector<int64_t>& lora_shards,
                         const std::optional<at::Tensor>& demoted_scales) {
  at::Tensor out;
  const Adapters adapters = adapters_of(lora_slots, lora, lora_shards);
  kvslim_team::with_team([&] {
    out = run_layer(x, weights, extras, bits, outs, norms, eps, heads, kv_heads, head_dim, act,
                    cos, sin, k_cache, v_cache, slots, block_tables, context_lens, key_start,
                    window, scale, adapters, demoted_scales);
  });
  return out;
}

template <class T>
std::vector<T> part(const std::vector<T>& all, size_t layer, size_t each) {
  return std::vector<T>(all.begin() + each * layer, all.begin() + each * (layer + 1));
}

// Every layer of a step in one call and one hold of the threads (a "CPU graph" without the
// capture: the same kernels as one call a layer, over the same buffers). Per layer: 8 weights,
// 4 extras, 4 bits, 4 outs, 6 norms, its cos and sin (Gemma's local and global RoPE), its two
// caches, and its attention's slots, tables, lengths, first key and window.
at::Tensor decoder_stack(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<std::optional<at::Tensor>>& extras,
                         const std::vector<int64_t>& bits, const std::vector<int64_t>& outs,
                         const std::vector<std::optional<at::Tensor>>& norms, double eps,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t act,
                         const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                         std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                         const std::vector<at::Tensor>& slots,
                         const std::vector<at::Tensor>& block_tables,
                         const std::vector<at::Tensor>& context_lens,
                         const std::vector<int64_t>& key_starts,
                         const std::vector<int64_t>& windows, double scale,
                         const std::optional<at::Tensor>& lora_slots,
                         const std::vector<at::Tensor>& lora, const std::vector<int64_t>& lora_shards,
                         const std::vector<std::optional<at::Tensor>>& demoted_scales) {
  const size_t L = k_caches.size();
  TORCH_CHECK(demoted_scales.empty() || demoted_scales.size() == L,
              "decoder_stack: demoted scales for every layer or none");
  TORCH_CHECK(!lora_slots || lora.size() == 8 * L, "decoder_stack: adapters take 8 tensors a layer");
  TORCH_CHECK(v_caches.size() == L && weights.size() == 8 * L && extras.size() == 4 * L &&
                  bits.size() == 4 * L && outs.size() == 4 * L && norms.size() == NORMS * L &&
                  cos.size() == L && sin.size() == L && slots.size() == L &&
                  block_tables.size() == L && context_lens.size() == L &&
                  key_starts.size() == L && windows.size() == L,
              "decoder_stack: each layer takes 8 weights, 4 extras, 4 bits, 4 outs, 6 norms, "
              "cos, sin, a key and a value cache and its attention's inputs");
  at::Tensor out = x;
  kvslim_team::with_team([&] {
    for (size_t l = 0; l < L; ++l)
      out = run_layer(out, part(weights, l, 8), part(extras, l, 4), part(bits, l, 4),
                      part(outs, l, 4), part(norms, l, NORMS), eps, heads, kv_heads, head_dim,
                      act, cos[l], sin[l], k_caches[l], v_caches[l], slots[l], block_tables[l],
                      context_lens[l], key_starts[l], windows[l], scale,
                      adapters_of(lora_slots, lora_slots ? part(lora, l, 8)
                                                         : std::vector<at::Tensor>{},
                                  lora_shards),
                      demoted_scales.empty() ? std::nullopt : demoted_scales[l]);
  });
  return out;
}

}  // namespace kvslim_decoder_layer

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("decoder_layer(Tensor x, Tensor[] weights, Tensor?[] extras, int[] bits, int[] outs, "
        "Tensor?[] norms, float eps, int heads, int kv_heads, int head_dim, int act, Tensor cos, "
        "Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, int key_start, int window, float scale, Tensor? lora_slots, "
        "Tensor[] lora, int[] lora_shards, Tensor? demoted_scales=None) -> Tensor");
  m.def("decoder_stack(Tensor x, Tensor[] weights, Tensor?[] extras, int[] bits, int[] outs, "
        "Tensor?[] norms, float eps, int heads, int kv_heads, int head_dim, int act, "
        "Tensor[] cos, Tensor[] sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor[] slots, Tensor[] block_tables, Tensor[] context_lens, int[] key_starts, "
        "int[] windows, float scale, Tensor? lora_slots, Tensor[] lora, "
        "int[] lora_shards, Tensor?[] demoted_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("rms_norm", &kvslim_decoder_layer::rms_norm);
  m.impl("decoder_layer", &kvslim_decoder_layer::decoder_layer);
  m.impl("decoder_stack", &kvslim_decoder_layer::decoder_stack);
}
