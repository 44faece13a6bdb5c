// cache[slots[i]] = values[i] for a paged KV cache [blocks, block_size, ...] (flat slot
// indices, as Python indexing takes them: a negative one counts from the end). A byte copy
// per row, so any cache dtype; the decode step calls it twice a layer, and the same write as a
// Python custom op cost ~30 us of dispatch a call (a tenth of a SmolLM2 step).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace kvslim_store_slots {

void write_slots(at::Tensor cache, const at::Tensor& slots, const at::Tensor& values) {
  TORCH_CHECK(cache.dim() >= 2 && cache.is_contiguous(), "write_slots: cache must be contiguous "
              "[blocks, block_size, ...]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "write_slots: slots must be "
              "1-D int64");
  TORCH_CHECK(values.scalar_type() == cache.scalar_type(), "write_slots: values are ",
              values.scalar_type(), ", the cache ", cache.scalar_type());
  const int64_t total = cache.size(0) * cache.size(1);
  const int64_t row = total ? cache.numel() / total : 0;
  TORCH_CHECK(values.numel() == slots.numel() * row, "write_slots: ", slots.numel(),
              " slots of ", row, " elements, values hold ", values.numel());
  const at::Tensor vc = values.contiguous(), sc = slots.contiguous();
  const int64_t bytes = row * cache.element_size();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const char* src = (const char*)vc.data_ptr();
  char* dst = (char*)cache.data_ptr();
  for (int64_t i = 0; i < sc.numel(); ++i) {
    const int64_t s = sp[i] < 0 ? sp[i] + total : sp[i];
    TORCH_CHECK(s >= 0 && s < total, "write_slots: slot ", sp[i], " is outside the cache's ",
                total, " slots");
    std::memcpy(dst + s * bytes, src + i * bytes, bytes);
  }
}


}  // namespace kvslim_store_slots

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("write_slots(Tensor(a!) cache, Tensor slots, Tensor values) -> ()");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("write_slots", &kvslim_store_slots::write_slots);
}
