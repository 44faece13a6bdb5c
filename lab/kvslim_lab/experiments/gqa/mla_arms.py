"""The study's MLA arms: a model converted to DeepSeek-V2's latent attention (`kvslim convert
--to-mla`, surgery/mla/) with exactly the KV bytes per token of a GQA conversion with k KV heads
per layer, so that the two are compared at one cache size.

An arm's cached row per token and layer (kv_lora_rank + qk_rope_head_dim) is the K + V width of
k KV heads (`ModelConfig.kv_elements_per_token`, per layer); `rope_fraction` of it is the shared
RoPE key, the rest the latent. The latent norm is the study's choice per model
(`--latent-norm`, docs/mla-conversion.md): `calibrated` on ref-mha, `exact` on SmolLM2, whose
tokens of outlying latent RMS a calibrated norm does not let through."""
from __future__ import annotations

from pathlib import Path

from kvslim.models.config import ModelConfig
from kvslim.surgery.mla.convert import convert_to_mla
from kvslim.surgery.mla.options import MLAOptions, mla_widths

# arm -> `convert --to-mla --method`: transmla is the arm that is uptrained; mha2mla's partial
# RoPE is far behind it before uptraining (docs/mla-conversion.md), so it is scored at alpha = 0
# only, for comparison, and not trained.
MLA_CONVERSIONS = {"mla": "transmla", "mla-mha2mla": "mha2mla"}
CONVERSION_ONLY = ("mla-mha2mla",)


def is_mla(method: str) -> bool:
    return method.removesuffix("-kd") in MLA_CONVERSIONS


def convert_mla_arm(src: str | Path, out: Path, k: float, method: str, calib: str,
                    calib_samples: int, calib_seq_len: int, rope_fraction: float,
                    latent_norm: str, show_progress: bool) -> Path:
    """`out`: `src` as the MLA arm `method` (a key of MLA_CONVERSIONS) at GQA-k's KV bytes."""
    config = ModelConfig.from_dir(src)
    conversion = MLA_CONVERSIONS[method]
    rope_dim, rank = mla_widths(config, k, conversion, rope_fraction)
    options = MLAOptions(conversion, rank, rope_dim, latent_norm, calib, calib_samples,
                         calib_seq_len)
    return convert_to_mla(src, out, options, show_progress=show_progress)
