"""DeepSeek's multi-head latent attention (MLA).

Queries come from `q_proj`, or through a low-rank bottleneck (`q_a_proj`, its RMSNorm
`q_a_layernorm`, `q_b_proj`) when the model has a `q_lora_rank`. Keys and values come from one
compressed latent per token: `kv_a_proj_with_mqa` gives the latent (`kv_lora_rank`) and one
RoPE key (`qk_rope_head_dim`) that every head shares; the latent, normalised by
`kv_a_layernorm`, is expanded by `kv_b_proj` into each head's no-RoPE key part
(`qk_nope_head_dim`) and its value (`v_head_dim`). A head's key is [k_nope, k_rope], its query
[q_nope, q_rope].

DeepSeek rotates interleaved pairs of the RoPE part ((0, 1), (2, 3), ...: V2 by a complex
product, V3 by `apply_rotary_pos_emb_interleave`), kvslim's `apply_rope` rotates the two
halves; reordering the RoPE part evens first, odds after (as V3's own rotation returns it)
makes the two the same rotation, and q and k reordered alike keep every q·k. The checkpoint's
weights are not touched. (A V3 config with `rope_interleave` false rotates halves directly.)

Two forms of the same attention, chosen by the backend context (`attn.caches_latent`):
- absorbed (the engine, over its latent cache, attention/latent_cache.py): as DeepSeek and vLLM,
  kv_b_proj's rows are split per head into W_UK [qk_nope, kv_lora_rank] and W_UV [v_head_dim,
  kv_lora_rank]; q_latent = q_nope @ W_UK, and each head attends with [q_latent; q_rope] over
  one shared key per token, the cached row [c_kv; k_rope] (c_kv after kv_a_layernorm), whose
  value is c_kv; the head's output is out_latent @ W_UV^T. Multi-query attention over
  kv_lora_rank + qk_rope_head_dim per token and layer: decodes and prefill chunks alike read the
  latent (no expansion of the cached context). W_UK and W_UV are copied out of kv_b_proj once
  (`absorb`, before the linear kernels take the weights), and multiplied per head by
  kernels/head_mm.py (on the CPU in float32: a row's numbers whatever the batch).
- expanded (dense: training, `model.logits`): K and V per head, with as many KV heads as query
  heads and head_dim = qk_nope_head_dim + qk_rope_head_dim; values are zero-padded to that width
  (the dense backend's one head_dim) and the output is cut back to v_head_dim before `o_proj`
  (exact: a padded dimension only ever meets zeros)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.kernels import head_mm as head_mm_kernel
from kvslim.kernels.head_mm import head_mm
from kvslim.layers.linear import LinearQuantization, make_linear
from kvslim.layers.norm import RMSNorm
from kvslim.layers.rope import apply_rope

# transformers builds the q and kv latents' norms with RMSNorm's default, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mla, layer_idx: int, scale: float,
                 bias: bool = False, quant: LinearQuantization | None = None):
        """mla: the model's `MLAConfig` (ranks, head widths, rope_interleave). bias:
        transformers' `attention_bias`, on q_a_proj, kv_a_proj_with_mqa and o_proj only."""
        super().__init__()
        self.layer_idx, self.num_heads, self.scale = layer_idx, num_heads, scale
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank, self.interleaved = mla.kv_lora_rank, mla.rope_interleave
        self.head_dim = self.nope + self.rope
        q_out = num_heads * self.head_dim
        if mla.q_lora_rank is None:
            self.q_proj = make_linear(hidden_size, q_out, False, quant)
        else:
            self.q_a_proj = make_linear(hidden_size, mla.q_lora_rank, bias, quant)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = make_linear(mla.q_lora_rank, q_out, False, quant)
        self.kv_a_proj_with_mqa = make_linear(hidden_size, self.kv_lora_rank + self.rope, bias,
                                              quant)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = make_linear(self.kv_lora_rank, num_heads * (self.nope + self.v_dim),
                                     False, quant)
        self.o_proj = make_linear(num_heads * self.v_dim, hidden_size, bias, quant)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on [..., heads, qk_rope_head_dim], DeepSeek's interleaved pairs as halves."""
        if self.interleaved:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    @torch.no_grad()
    def absorb(self) -> None:
        """Keep W_UK [heads, qk_nope, kv_lora_rank] and W_UV^T [heads, kv_lora_rank, v_head_dim]
        out of kv_b_proj's weight (dequantized for a quantized layer), as non-persistent
        buffers: call it while the weight is readable (before `prepare_for_inference`)."""
        head_mm_kernel.available()          # resolved here, outside any compiled step
        proj = self.kv_b_proj
        w = proj.dequantized_weight() if hasattr(proj, "dequantized_weight") else proj.weight
        w = w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        dtype = self.kv_a_layernorm.weight.dtype
        self.register_buffer("w_uk", w[:, :self.nope].to(dtype).contiguous(), persistent=False)
        self.register_buffer("w_uv_t", w[:, self.nope:].transpose(1, 2).to(dtype).contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """x [..., hidden] where ... is [B, T] (dense) or [N] (paged); cos/sin [...,
        qk_rope_head_dim]; attn is the backend context."""
        lead, h = x.shape[:-1], self.num_heads
        q = self._queries(x).view(*lead, h, self.head_dim)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = self._rotate(k_rope.unsqueeze(-2), cos, sin)          # [..., 1, rope]
        q_nope, q_rope = q[..., :self.nope], self._rotate(q[..., self.nope:], cos, sin)
        if attn.caches_latent(self.layer_idx):
            out = self._attend_absorbed(q_nope, q_rope, latent, k_rope, attn)
        else:
            out = self._attend_expanded(q_nope, q_rope, latent, k_rope, attn)
        return self.o_proj(out.reshape(*lead, h * self.v_dim))

    def _attend_absorbed(self, q_nope, q_rope, latent, k_rope, attn) -> torch.Tensor:
        """Over the latent cache: q_nope, q_rope [N, H, *]; latent [N, kv_lora_rank]; k_rope
        [N, 1, rope]. Returns [N, H, v_head_dim]."""
        if not hasattr(self, "w_uk"):
            self.absorb()
        q_latent = head_mm(q_nope, self.w_uk)
        q = torch.cat((q_latent, q_rope), dim=-1)                      # [N, H, L + rope]
        row = torch.cat((latent.unsqueeze(-2), k_rope), dim=-1)        # [N, 1, L + rope]
        out = attn.attend(self.layer_idx, q, row, row[..., :self.kv_lora_rank], self.scale)
        return head_mm(out, self.w_uv_t)

    def _attend_expanded(self, q_nope, q_rope, latent, k_rope, attn) -> torch.Tensor:
        """Every head's K and V from the latent (dense attention). Returns [..., H, v_dim]."""
        lead, h = latent.shape[:-1], self.num_heads
        kv = self.kv_b_proj(latent).view(*lead, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(*lead, h, self.rope)), dim=-1)
        v = F.pad(v, (0, self.head_dim - self.v_dim))
        return attn.attend(self.layer_idx, q, k, v, self.scale)[..., :self.v_dim]
