// GCC vector types of floats, and the fixed tree that sums a 16-lane partial sum: lane l + 8,
// then l + 4, l + 2, l + 1 (-ffp-contract=off keeps each sum rounded as written). Every kernel
// whose dot products run as 16 interleaved lanes ends them here, so they all end alike.
#pragma once

namespace kvslim_vec {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));

__attribute__((always_inline)) inline float tree_sum(f32x16 part) {
  const f32x8 p8 = __builtin_shufflevector(part, part, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(part, part, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 p4 = __builtin_shufflevector(p8, p8, 0, 1, 2, 3) +
                   __builtin_shufflevector(p8, p8, 4, 5, 6, 7);
  const f32x2 p2 = __builtin_shufflevector(p4, p4, 0, 1) + __builtin_shufflevector(p4, p4, 2, 3);
  return p2[0] + p2[1];
}

}  // namespace kvslim_vec
