"""config.json `quantization_config` of AWQ checkpoints (AutoAWQ, transformers' AwqConfig:
quant_method "awq"), read as a `QuantSpec`. The tensors are converted to GPTQ's at load
(formats/awq.py), so AWQ layers are `GPTQLinear`s."""
from __future__ import annotations

from typing import Any

from kvslim.errors import ConfigError
from kvslim.quantization.base import QuantSpec
from kvslim.quantization.gptq import GPTQLinear
from kvslim.quantization.registry import register

PREFIX = "config.json: quantization_config"
# The only AWQ version whose tensors kvslim reads: qweight [in, out / 8] in AWQ's nibble order.
# GEMV, GEMV-fast and Marlin pack differently (and "exllama"/"ipex" name loading backends).
VERSIONS = ("gemm",)


def awq_spec(cfg: dict[str, Any]) -> QuantSpec:
    # vLLM's AWQConfig accepts AutoAWQ's own key names too (w_bit, q_group_size).
    bits = cfg.get("bits", cfg.get("w_bit"))
    group = cfg.get("group_size", cfg.get("q_group_size"))
    version = cfg.get("version", "gemm")
    zero_point = cfg.get("zero_point", True)
    if bits != 4:
        raise ConfigError(f"{PREFIX} bits {bits!r} is not supported for quant_method 'awq' "
                          "(AWQ checkpoints are 4-bit)")
    if not isinstance(version, str) or version.lower() not in VERSIONS:
        raise ConfigError(f"{PREFIX} version {version!r} is not supported for quant_method "
                          f"'awq' (only {' or '.join(VERSIONS)}: GEMV and other versions pack "
                          "their tensors differently)")
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise ConfigError(f"{PREFIX} group_size {group!r} must be a positive integer or -1")
    if not isinstance(zero_point, bool):
        raise ConfigError(f"{PREFIX} zero_point {zero_point!r} must be true or false")
    skipped = cfg.get("modules_to_not_convert")
    if skipped is not None and not (isinstance(skipped, list)
                                    and all(isinstance(s, str) for s in skipped)):
        raise ConfigError(f"{PREFIX} modules_to_not_convert {skipped!r} must be a list of names")
    # zero_point only says how the grid was chosen: the GEMM layout always stores qzeros, and
    # they are read as stored either way (as vLLM's awq.py does).
    return QuantSpec(4, group, desc_act=False, sym=not zero_point, checkpoint_format="gemm",
                     method="awq")


register("awq", GPTQLinear, "awq", awq_spec)
