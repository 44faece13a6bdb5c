"""Stored weight bytes, from safetensors headers and GGUF tensor tables, without loading."""
from kvslim.formats.gguf.exporter import export_gguf
from kvslim.formats.weight_bytes import gguf_weight_bytes, stored_weight_bytes

# The "tied" variant: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, FFN 128, vocab 320.
LINEAR = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128)
OTHER = 320 * 64 + 2 * 2 * 64 + 64                 # embedding (tied head), norms


def test_float_checkpoint_counts_the_tied_head_once(hf_checkpoints):
    wb = stored_weight_bytes(hf_checkpoints["tied"])
    assert (wb.total, wb.linear) == (4 * (LINEAR + OTHER), 4 * LINEAR)


def test_gguf_file_counts_its_tensors(hf_checkpoints, tmp_path):
    f32 = gguf_weight_bytes(export_gguf(hf_checkpoints["tied"], tmp_path / "m.gguf", "f32",
                                        show_progress=False))
    assert (f32.total, f32.linear) == (4 * (LINEAR + OTHER), 4 * LINEAR)
    f16 = gguf_weight_bytes(export_gguf(hf_checkpoints["tied"], tmp_path / "h.gguf", "f16",
                                        show_progress=False))
    assert f16.linear == 2 * LINEAR                  # norms stay f32 in an f16 export
