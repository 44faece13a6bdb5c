"""config.json `quantization_config` of compressed-tensors checkpoints (what llm-compressor
writes: quant_method "compressed-tensors"), read as a `QuantSpec`.

A config names a storage `format` (at the top, or per config group) and per config group a
scheme: which modules (`targets`), how their weights are quantized (`weights`) and whether their
activations are (`input_activations`). `FORMATS` maps each storage format kvslim reads to the
function that checks a scheme stored in it; a format missing there is refused with its name, and
a new one is one more entry. A `sparsity_config` names how the linears' weights are stored
sparse (`SPARSITY_FORMATS`; the tensors: formats/compressed_tensors_sparse.py); without
config_groups the weights are float. "pack-quantized" tensors are converted to GPTQ's at load
(formats/compressed_tensors.py), so those layers are `GPTQLinear`s; "int-quantized" is W8A8
(w8a8.py). Field meanings and defaults follow compressed-tensors' `QuantizationArgs`
(quantization/quant_args.py)."""
from __future__ import annotations

from typing import Any, Callable

from kvslim.errors import ConfigError
from kvslim.quantization.base import QuantSpec
from kvslim.quantization.gptq import GPTQLinear
from kvslim.quantization.registry import register
from kvslim.quantization.w8a8 import INPUTS, W8A8_SPEC, WEIGHTS

PREFIX = "config.json: quantization_config"
# Features of a config kvslim would silently get wrong if it ignored them.
UNSUPPORTED_KEYS = {"kv_cache_scheme": "KV-cache quantization scales",
                    "transform_config": "weight transforms"}
# actorder values (aliases included): "group" stores weight_g_idx, "weight" only changed the
# order GPTQ quantized the columns in, which the stored tensors do not show.
ACTORDER_GROUP = (True, "group", "dynamic")
ACTORDER_NONE = (None, False, "weight", "static")
# sparsity_config formats read: bitmask-compressed weights, decompressed at load, or "dense"
# (weights stored as without sparsity; the config only records it).
SPARSITY_FORMATS = ("sparse-bitmask", "sparse-24-bitmask", "dense")


def weight_only_int(scheme: dict[str, Any], where: str) -> QuantSpec:
    """A scheme in format "pack-quantized": 4- or 8-bit integer weights, float activations."""
    for key in ("input_activations", "output_activations"):
        if scheme.get(key) is not None:
            raise ConfigError(f"{PREFIX} {where}.{key} is set: format 'pack-quantized' is read "
                              "for weight-only quantization, activations stay float")
    w = scheme.get("weights")
    if not isinstance(w, dict):
        raise ConfigError(f"{PREFIX} {where}.weights must be an object (the weights' scheme)")
    where = f"{where}.weights"
    kind, bits = str(w.get("type", "int")).lower(), w.get("num_bits", 8)
    if kind != "int":
        raise ConfigError(f"{PREFIX} {where}.type {kind!r} is not supported (int)")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ConfigError(f"{PREFIX} {where}.num_bits {bits!r} is not supported (4 or 8)")
    if w.get("dynamic") not in (None, False):
        raise ConfigError(f"{PREFIX} {where}.dynamic {w['dynamic']!r} is not supported "
                          "(weights need stored scales)")
    actorder = w.get("actorder")
    actorder = actorder.lower() if isinstance(actorder, str) else actorder
    if actorder not in ACTORDER_GROUP + ACTORDER_NONE:
        raise ConfigError(f"{PREFIX} {where}.actorder {w['actorder']!r} is not supported "
                          "('group', 'weight' or null)")
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ConfigError(f"{PREFIX} {where}.symmetric {symmetric!r} must be true or false")
    return QuantSpec(bits, _group_size(w, where), desc_act=actorder in ACTORDER_GROUP,
                     sym=symmetric, checkpoint_format="pack-quantized",
                     method="compressed-tensors")


def _group_size(w: dict[str, Any], where: str) -> int:
    """One scale per `group_size` inputs ("group") or per output row ("channel": -1). Without a
    strategy, compressed-tensors infers it from group_size."""
    group = w.get("group_size")
    strategy = w.get("strategy")
    if strategy is None:
        strategy = {None: "tensor", -1: "channel"}.get(group, "group")
    strategy = str(strategy).lower()
    if strategy == "channel":
        return -1
    if strategy != "group":
        raise ConfigError(f"{PREFIX} {where}.strategy {strategy!r} is not supported "
                          "('group' or 'channel')")
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise ConfigError(f"{PREFIX} {where}.group_size {group!r} must be a positive integer "
                          "for strategy 'group'")
    return group


def int8_weights_and_activations(scheme: dict[str, Any], where: str) -> QuantSpec:
    """A scheme in format "int-quantized": W8A8, int8 per-channel weights and int8 activations
    quantized per token at run time (w8a8.py), the only such scheme read."""
    where = f"{PREFIX} {where}"
    if scheme.get("output_activations") is not None:
        raise ConfigError(f"{where}.output_activations is not supported (must be null)")
    for part, want in (("weights", WEIGHTS), ("input_activations", INPUTS)):
        args = scheme.get(part)
        if not isinstance(args, dict):
            raise ConfigError(f"{where}.{part} is missing (W8A8 needs weights and "
                              "input_activations)")
        for key, value in want.items():
            if args.get(key, False if key == "dynamic" else None) != value:
                raise ConfigError(f"{where}.{part}.{key} is {args.get(key)!r}; kvslim reads "
                                  f"{value!r} (int8 per-channel weights, dynamic per-token "
                                  "activations)")
    if scheme["weights"].get("group_size") not in (None, -1):
        raise ConfigError(f"{where}.weights.group_size must be null for strategy 'channel'")
    return W8A8_SPEC


# Storage format -> the check of one config group's scheme stored in it. Formats that store
# other tensors (float-quantized, naive-quantized, nvfp4-pack-quantized, marlin-24, ...) are
# added here with their own check and tensor reader.
FORMATS: dict[str, Callable[[dict[str, Any], str], QuantSpec]] = {
    "pack-quantized": weight_only_int,
    "int-quantized": int8_weights_and_activations,
}


def sparsity_format(cfg: dict[str, Any]) -> str | None:
    """The storage format of the config's `sparsity_config`, None without one."""
    sparsity = cfg.get("sparsity_config")
    if not sparsity:
        return None
    if not isinstance(sparsity, dict):
        raise ConfigError(f"{PREFIX} sparsity_config must be an object")
    fmt = sparsity.get("format")
    if fmt not in SPARSITY_FORMATS:
        raise ConfigError(f"{PREFIX} sparsity_config.format {fmt!r} is not supported "
                          f"({', '.join(map(repr, SPARSITY_FORMATS))})")
    return fmt


def compressed_tensors_spec(cfg: dict[str, Any]) -> QuantSpec | None:
    """The one QuantSpec every quantized linear layer of the model follows; None for a
    sparse-only checkpoint (a sparsity_config, no config_groups: float weights)."""
    for key, what in UNSUPPORTED_KEYS.items():
        if cfg.get(key):
            raise ConfigError(f"{PREFIX} {key} is set: {what} are not supported")
    if sparsity_format(cfg) is not None and not cfg.get("config_groups"):
        return None
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(f"{PREFIX} quantization_status {status!r} is not supported "
                          "('compressed': the stored tensors are the quantized ones)")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{PREFIX} config_groups must be a non-empty object of schemes")
    specs = {}
    for name, scheme in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(scheme, dict):
            raise ConfigError(f"{PREFIX} {where} must be a scheme object")
        fmt = scheme.get("format") or cfg.get("format")
        if fmt not in FORMATS:
            raise ConfigError(f"{PREFIX} format {fmt!r} is not supported for quant_method "
                              f"'compressed-tensors' ({', '.join(map(repr, FORMATS))})")
        specs[name] = FORMATS[fmt](scheme, where)
    names = list(specs)
    for name in names[1:]:
        if specs[name] != specs[names[0]]:
            raise ConfigError(f"{PREFIX} config_groups {names[0]} and {name} quantize weights "
                              "differently: kvslim runs one scheme for every linear layer")
    return specs[names[0]]


def pack_config(spec: QuantSpec) -> dict:
    """config.json's quantization_config for `spec` in format "pack-quantized", the fields
    llm-compressor writes for its W4A16 schemes (one group for every Linear, lm_head left
    out)."""
    channel = spec.group_size == -1
    weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym,
               "strategy": "channel" if channel else "group",
               "group_size": None if channel else spec.group_size, "dynamic": False,
               "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}}}


register("compressed-tensors", GPTQLinear, "compressed-tensors",
         compressed_tensors_spec, pack_config)
