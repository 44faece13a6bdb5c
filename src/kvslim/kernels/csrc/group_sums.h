// Each row's sum of x [M, K] over each group of `group` inputs, in order, into out [M, K / group]:
// what the 4-bit offsets multiply, in tiled_gemm.cpp's kernel and group_q8.cpp's alike.
#pragma once
#include <cstdint>

namespace kvslim_cpu {
void group_sums(const float* x, float* out, int64_t M, int64_t K, int64_t group);
}
