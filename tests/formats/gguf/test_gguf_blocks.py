"""Each kept GGUF block type decodes to q * s + m equal, bit for bit, to gguf.quants.dequantize
(llama.cpp's dequantize_row_*) on random blocks, including zero and negative scales."""
import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as Q

from kvslim.formats.gguf.blocks import BLOCK_SIZES, GROUP, TYPE_IDS, decode_blocks

BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q6_K": (208,)}


def random_raw(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = cols // BLOCK_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, blocks, BYTES[kind]), dtype=np.uint8)
    for at in F16_FIELDS[kind]:          # any finite float16, 0 and negatives included
        d = (rng.normal(size=(rows, blocks, 1)) * 0.05).astype(np.float16)
        d[0, 0] = 0
        raw[..., at:at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(TYPE_IDS))
def test_decoding_is_bit_exact(kind):
    rows, cols = 5, 512
    raw = random_raw(kind, rows, cols, seed=TYPE_IDS[kind])
    b = decode_blocks(raw, kind, rows, cols)
    assert b["qvalues"].dtype == torch.uint8 and b["scales"].shape == (rows, cols // GROUP)
    w = b["qvalues"].float().view(rows, -1, GROUP) * b["scales"][..., None] + b["mins"][..., None]
    ref = torch.from_numpy(gguf.quants.dequantize(raw, getattr(Q, kind)).reshape(rows, cols))
    assert torch.equal(w.view(rows, cols), ref)
    assert int(b["qvalues"].max()) <= {"Q8_0": 255, "Q6_K": 63, "Q5_0": 31}.get(kind, 15)


def test_the_layers_read_the_same_type_ids():
    """BlockQuantLinear's kernels read the decoder's ids (both from quantization/gguf_blocks.py)."""
    from kvslim.formats.gguf.blocks import BITS, ZERO
    from kvslim.quantization import gguf_blocks as layer
    assert layer.GROUP == GROUP
    assert set(layer.FOUR_BIT_TYPES) == {TYPE_IDS[k] for k, b in BITS.items() if b == 4}
    assert layer.EIGHT_BIT_ZEROS == {TYPE_IDS[k]: z for k, z in ZERO.items()}
    assert {int(getattr(Q, k)) for k in TYPE_IDS} == set(TYPE_IDS.values())
