"""Weight quantization: each method's config parser, layer class and kernels, registered when
first asked for (registry.py)."""
from kvslim.quantization.base import QuantLinear, QuantSpec

__all__ = ["QuantLinear", "QuantSpec"]
