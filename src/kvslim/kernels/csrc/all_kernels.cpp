// Every kernel in one translation unit: each source alone spends most of its compile parsing
// torch's headers (ATen.h and torch/library.h: about 15 s a file here), so one unit parses them
// once and the first-use build takes a third of the CPU time. Each file keeps its helpers in a
// namespace of its own, so their names do not meet here.
#include "tiled_gemm.cpp"
#include "group_sums.cpp"
#include "group_q8.cpp"
#include "paged_attention.cpp"
#include "store_slots.cpp"
#include "sparse24_gemm.cpp"
#include "head_mm.cpp"
#include "lora_sgmv.cpp"      // before decoder_layer.cpp, which adds adapters with it
#include "decoder_layer.cpp"
