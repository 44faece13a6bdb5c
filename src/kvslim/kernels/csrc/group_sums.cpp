#include "group_sums.h"

#include <ATen/Parallel.h>
#include "thread_team.h"

namespace kvslim_cpu {

void group_sums(const float* x, float* out, int64_t M, int64_t K, int64_t group) {
  const int64_t groups = K / group;
  kvslim_team::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0.f;
        for (int64_t k = 0; k < group; ++k) sum += x[r * K + g * group + k];
        out[r * groups + g] = sum;
      }
  });
}

}  // namespace kvslim_cpu
