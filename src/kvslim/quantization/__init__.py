"""Weight quantization: each method's config parser, layer class and kernels (registry.py).

Importing the package registers every method, in the order `QuantSpec.from_hf`'s error lists
their quant_method names."""
from kvslim.quantization import gptq, awq, compressed_tensors, w8a8, gguf_blocks  # noqa: F401
from kvslim.quantization.base import QuantLinear, QuantSpec

__all__ = ["QuantLinear", "QuantSpec"]
