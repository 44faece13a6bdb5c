"""kvslim_lab/bench/kernel_choice.py: which shipped kernel a quantized layer should run at each row
count, read from `kvslim bench kernels`' timings."""


def test_choices_name_the_shipped_kernels_and_the_faster_for_a_w8a8_layer():
    from kvslim_lab.bench.kernels import KernelTiming
    from kvslim_lab.bench.kernel_choice import choose
    from kvslim.quantization.kernels import W8A8_MIN_ROWS

    def timing(candidate, family, rows, us):
        return KernelTiming("qkv", 576, 960, candidate, family, rows, us, 1.0, 1.0, 0.0)
    timings = [timing("fp32.mm_in_out", "fp32", 1, 30.0),
               timing("fp32.onednn_packed", "fp32", 1, 40.0),
               timing("fp32.onednn_packed", "fp32", 8, 50.0),
               timing("int8.weight_int8pack_mm_bf16", "int8", 1, 20.0),
               timing("int8.weight_int8pack_mm_bf16", "int8", 8, 90.0),
               timing("w8a8.int_mm", "w8a8", 1, 25.0), timing("w8a8.int_mm", "w8a8", 8, 40.0),
               timing("int4-g32.int4pack_mm_for_cpu_bf16", "int4-g32", 8, 80.0),
               timing("int4-g32.bf16_copy_mm", "int4-g32", 8, 45.0)]
    first, second = choose(timings)
    assert (first.rows, first.us["fp32"], first.w8a8_layer) == (1, 30.0, "int8")
    assert (second.us["fp32"], second.w8a8_layer, second.us["int4-g32"]) == (50.0, "w8a8", 80.0)
    assert second.us["int4-g32.bf16_copy_mm"] == 45.0
    assert second.us["int4-g32.w8a8_per_group_int_mm"] is None and first.us["int4-g32"] is None
    assert first.w8a8_stored == ("w8a8" if W8A8_MIN_ROWS <= 1 else "int8")
