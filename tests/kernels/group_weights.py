"""Random group-quantized weights for the kernel tests: 4-bit q 0..15 with mins, or int8 q."""
import torch


def weight(bits: int, out: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (out, k), dtype=torch.uint8, generator=g)
        mins = torch.randn(out, k // group, generator=g)
    else:
        q = torch.randint(-128, 128, (out, k), dtype=torch.int8, generator=g)
        mins = None
    scales = torch.rand(out, k // group, generator=g) * 0.1
    return q, scales, mins
