"""What every model family declares, and the pieces families share. Each family's file in
models/ ends with one `Family`: its config.json fields, its model class, its checkpoint-name
rule, how llama.cpp's GGUF files store it (`GGUFLayout`: data, which formats/gguf/ reads and
writes by) and what kvslim does with it; models/families.py registers them. Code outside
models/ asks the family (`family_of(config)`) instead of testing architecture names."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvslim.models.config import ModelConfig

# A GGUF decoder layer's tensors (blk.N.<name>) -> kvslim's module names, shared by families:
# per-head q/k norms (Qwen3, Gemma 3) and a sparse MoE layer's router and its experts'
# projections, each stacked over the experts (formats/gguf/moe.py)
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
MOE_LAYER_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                     "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp's converter stores a family. Several families can share one GGUF
    architecture (Llama, Mistral and Mixtral are all `llama` files): formats/gguf/archs.py
    merges their tables per architecture."""
    arch: str                              # general.architecture
    layer_tensors: Mapping[str, str]       # blk.N.<name> -> kvslim's module name
    # Q/K rows reordered for llama.cpp's RoPE, which rotates adjacent pairs (only `llama`; the
    # others run with transformers' half-split RoPE)
    permutes_qk: bool = False
    norms_plus_one: bool = False           # norm weights stored as 1 + w (Gemma's norms)
    experts: bool = False                  # a file with `{arch}.expert_count` is this family
    expert_width_key: bool = False         # the experts' width is {arch}.expert_feed_forward_length
    sliding_window: bool = False           # {arch}.attention.sliding_window is the config's
    imports: bool = True                   # import-gguf reads such files as this family
    exports: bool = True                   # export-gguf writes this family
    float_only: bool = False               # imported as float32 only (no block-kept layouts)
    # The config fields the file implies beyond the keys every architecture has, from
    # (key(name): a required {arch}.<name>, optional(name, default), head_dim)
    fields: Callable[..., dict[str, Any]] | None = None


def no_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


def write_attention_bias(config: ModelConfig, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = config.qkv_bias


def never_translated(name: str) -> bool:
    return False


def same_name(name: str, tensor: torch.Tensor, config: ModelConfig
              ) -> Iterator[tuple[str, torch.Tensor]]:
    yield name, tensor


def same_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    return state


@dataclass(frozen=True)
class Family:
    """One model family: what its file in models/ declares once."""
    model_type: str                        # config.json's model_type
    architecture: str                      # config.json's architectures[0]
    name: str                              # as messages name it ("Gemma 3")
    model_class: type | None               # None: read for its shapes only (the planner)
    # config.json -> the ModelConfig fields it sets beyond (or instead of) the common ones
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]] = no_fields
    # ModelConfig -> config.json: the family's own keys, written into the common ones
    write_hf: Callable[[ModelConfig, dict[str, Any]], None] = write_attention_bias
    # The weight-name rule at the checkpoint boundary. Inside kvslim every model's tensors go by
    # the Llama family's HF names (q_proj, k_proj, v_proj, gate_proj, up_proj); a family whose
    # checkpoints name or stack them otherwise (Phi-3's fused projections, Mixtral's experts)
    # translates once when a checkpoint is read and once when one is written.
    translates: Callable[[str], bool] = never_translated
    from_checkpoint: Callable[..., Iterator[tuple[str, Any]]] = same_name
    to_checkpoint: Callable[..., dict[str, Any]] = same_state
    gguf: GGUFLayout | None = None
    norms_per_layer: int = 2               # RMSNorms in a decoder layer (Gemma: around both blocks)
    # Whether AWQ and SmoothQuant can fold their scales into the norm before each linear
    scale_folding: bool = True
    # Dense attention whose q/k/v map one to one onto DeepSeek-V2's (`kvslim convert --to-mla`)
    converts_to_mla: bool = False
    # Why its quantized checkpoints are refused (None: they load)
    quantized_unsupported: str | None = None

    @property
    def runnable(self) -> bool:
        return self.model_class is not None

    @property
    def supports_gguf_export(self) -> bool:
        return self.gguf is not None and self.gguf.exports
