"""An EAGLE-1-style head (Li et al. 2024): one decoder layer that reads the model's own last hidden
states and guesses the next one. At position i its input is `fc([embed(x_{i+1}); f_i])` — the
token that hidden state f_i drew, beside f_i itself — and its output f^_{i+1} goes through the
model's LM head to guess x_{i+2}. Drafting feeds each guess and its f^ back in, one layer per draft
token instead of the whole model.

Two choices differ from the paper's, both for a small CPU, where a draft step is paid in bytes
read and in ops: the layer attends over a sliding window of the last `window` positions (so an
engine keeps only that much per sequence), and the LM head is cut to a draft vocabulary of the
tokens the model says most often (as EAGLE-3 and FR-Spec do; `d2t`/`t2d` in EAGLE-3's form).

On disk: `config.json` (EagleConfig's fields) and `model.safetensors` under EAGLE's key names —
`fc.weight`/`fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{gate,up,down}_proj.weight` (layer 0
has no input norm, as in EAGLE) — plus `d2t` (draft id -> target id minus draft id) and `t2d`
(which target ids are in the draft vocabulary)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kvslim.errors import KvslimError
from kvslim.layers.linear import Linear
from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.norm import RMSNorm
from kvslim.layers.rope import RotaryEmbedding
from kvslim.layers.self_attention import Attention

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Fused parameter -> (EAGLE's name of each shard, in order)
_SHARDS = {"layers.0.self_attn.qkv_proj.weight": ("q", "k", "v"),
           "layers.0.mlp.gate_up_proj.weight": ("gate", "up")}
_SHARD_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj"}


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    window: int = 64                  # positions the layer attends over, its own included
    draft_vocab_size: int = 0         # 0: the whole vocabulary
    base_model_name_or_path: str = ""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise KvslimError(f"the EAGLE window must be >= 1, got {self.window}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise KvslimError(f"draft_vocab_size must be within 0..{self.vocab_size}, got "
                              f"{self.draft_vocab_size}")

    @classmethod
    def for_model(cls, mc, **overrides) -> "EagleConfig":
        """The head's shapes from the model's config (a ModelConfig), RoPE and norm included."""
        shapes = dict(hidden_size=mc.hidden_size, vocab_size=mc.vocab_size,
                      num_attention_heads=mc.num_attention_heads,
                      num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
                      intermediate_size=mc.intermediate_size, rope_theta=mc.rope_theta,
                      rms_norm_eps=mc.rms_norm_eps)
        return cls(**{**shapes, **overrides})


class EagleLayer(nn.Module):
    """The decoder layer: attention (no input norm) and a SwiGLU MLP, in float32."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                   c.head_dim, 0)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(x, cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = c = config
        self.fc = Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList([EagleLayer(c)])
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta)
        n = c.draft_vocab_size or c.vocab_size
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool)
                             if not c.draft_vocab_size else torch.zeros(c.vocab_size, dtype=torch.bool))
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(std=0.02)
                else:
                    p.zero_()
            self.layers[0].post_attention_layernorm.weight.fill_(1.0)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """The draft vocabulary: these target token ids, in this order."""
        ids = token_ids.long()
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target token id of each draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def forward(self, token_embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                attn) -> torch.Tensor:
        """[..., hidden] embeddings of x_{i+1} and hidden states f_i at positions i -> f^_{i+1}.
        `attn` is the attention context (`WindowAttention`)."""
        x = self.fc(torch.cat([token_embeds, feats], dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return self.layers[0](x, cos, sin, attn)

    # ---- files ---------------------------------------------------------------------------
    def save(self, out: str | Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        tensors = {}
        for name, tensor in self.state_dict().items():
            if name in _SHARDS:
                module = self.get_submodule(name.rpartition(".")[0])
                for key, view in module.shard_views(tensor).items():
                    tensors[f"layers.0.{_SHARD_NAMES[key]}.weight"] = view
            else:
                tensors[name] = tensor
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, out / WEIGHTS_FILE)

    @classmethod
    def load(cls, path: str | Path) -> "EagleHead":
        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise KvslimError(f"{path} is not an EAGLE drafter (needs {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE})")
        fields = json.loads((path / CONFIG_FILE).read_text())
        known = EagleConfig.__dataclass_fields__
        head = cls(EagleConfig(**{k: v for k, v in fields.items() if k in known}))
        expected = set(head._file_names())
        state = load_file(path / WEIGHTS_FILE)
        if set(state) != expected:
            raise KvslimError(f"{path / WEIGHTS_FILE}: tensors {sorted(set(state) ^ expected)[:4]} "
                              "missing or unexpected")
        own = head.state_dict()
        with torch.no_grad():
            for fused, keys in _SHARDS.items():
                module = head.get_submodule(fused.rpartition(".")[0])
                for key in keys:
                    tensor = state.pop(f"layers.0.{_SHARD_NAMES[key]}.weight")
                    module.weight_loader(own[fused], tensor, key)
            for name, tensor in state.items():
                own[name].copy_(tensor)
        return head

    def _file_names(self) -> list[str]:
        names = [n for n in self.state_dict() if n not in _SHARDS]
        return names + [f"layers.0.{_SHARD_NAMES[k]}.weight" for keys in _SHARDS.values()
                        for k in keys]

    def check_fits(self, hidden_size: int, vocab_size: int, model: str) -> None:
        """A one-line error before serving when the head was trained for another model."""
        c = self.config
        if (c.hidden_size, c.vocab_size) != (hidden_size, vocab_size):
            raise KvslimError(f"the EAGLE head was trained for hidden size {c.hidden_size} and "
                              f"vocabulary {c.vocab_size}; {model} has {hidden_size} and "
                              f"{vocab_size}")


BIG = 1 << 40          # the position of an empty key slot: later than any query, never attended


class WindowAttention:
    """The head's attention context: keys and values written into slots of per-row buffers
    (the K/V of earlier positions, kept by a proposer, already there), each query attending to
    the keys within `window` positions up to its own.

    k_buf/v_buf [B, L, kv_heads, head_dim]; key_pos [B, L] (BIG where empty); slots [B, T] where
    this pass's T rows go; q_pos [B, T]. With no buffers (training), the pass's own keys are the
    buffer."""

    def __init__(self, window: int, q_pos: torch.Tensor, slots: torch.Tensor | None = None,
                 k_buf: torch.Tensor | None = None, v_buf: torch.Tensor | None = None,
                 key_pos: torch.Tensor | None = None, key_valid: torch.Tensor | None = None):
        self.window, self.q_pos, self.slots = window, q_pos, slots
        self.k_buf, self.v_buf, self.key_pos = k_buf, v_buf, key_pos
        self.key_valid = key_valid          # training: [B, T] real (not padding) rows

    def attend(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        if self.k_buf is None:
            keys, values, key_pos = k, v, self.q_pos
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            self.k_buf[rows, self.slots] = k.to(self.k_buf.dtype)
            self.v_buf[rows, self.slots] = v.to(self.v_buf.dtype)
            keys, values, key_pos = self.k_buf, self.v_buf, self.key_pos
        qp, kp = self.q_pos[:, :, None], key_pos[:, None, :]
        mask = (kp <= qp) & (kp > qp - self.window)
        if self.key_valid is not None:      # a padding row still sees itself: no empty rows
            eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
            mask = (mask & self.key_valid[:, None, :]) | eye
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=mask[:, None], scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
