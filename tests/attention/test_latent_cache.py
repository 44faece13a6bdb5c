"""MLA's latent KV cache (attention/latent_cache.py) under DeepSeek's latent attention: the
absorbed attention over one cached row per token and layer computes what the expanded heads
compute densely, for a prompt in two chunks (the second over a cached prefix) and then decodes
beside another sequence; the value is a view of the key (nothing stored twice); an int8 latent
cache (one scale per row) stays within a bound of the float one; the C++ kernel is refused and
"auto" gathers."""
import pytest
import torch

from kvslim.attention import (DenseAttention, LatentKVCacheLayer, PagedAttention,
                              PagedStepLayout, PrefillChunk, build_paged_metadata,
                              latent_cache_layers, resolve_attention_backend)
from kvslim.layers.latent_attention import LatentAttention
from kvslim.layers.rope import RotaryEmbedding
from kvslim.models.shape_only import MLAConfig

BLOCK, BLOCKS, HIDDEN, HEADS = 4, 12, 32, 4
MLA = MLAConfig(kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                q_lora_rank=16)
WIDTH = MLA.kv_lora_rank + MLA.qk_rope_head_dim


def _layer() -> LatentAttention:
    torch.manual_seed(0)
    layer = LatentAttention(HIDDEN, HEADS, MLA, 0, (12 + 8) ** -0.5)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.eval()


def _cache(kv_dtype=None) -> LatentKVCacheLayer:
    rows = [torch.zeros(1, BLOCKS, BLOCK, 1, WIDTH, dtype=kv_dtype or torch.float32)]
    scales = None if kv_dtype is None else [torch.zeros(1, BLOCKS, BLOCK, 1,
                                                        dtype=torch.float16)]
    return latent_cache_layers(rows, scales, MLA.kv_lora_rank, torch.float32)[0]


def _slots(table, positions):
    return table[positions // BLOCK] * BLOCK + positions % BLOCK


def _paged(layer, cache, x, rope):
    """Sequence a (11 tokens): a chunk of 6, a chunk of 3 over the cached 6, then 2 decodes,
    the first beside a decode of sequence b (5 tokens, prefilled with a's first chunk)."""
    ta, tb = torch.tensor([5, 2, 9]), torch.tensor([7, 3])
    xa, xb = x[0], x[1, :5]
    outs = []

    def step(layout, rows, positions):
        cos, sin = rope.cos_sin(positions, torch.float32)
        meta = build_paged_metadata(layout, BLOCK)
        return layer(rows, cos, sin, PagedAttention([cache], meta))

    pos = torch.cat([torch.arange(6), torch.arange(5)])
    slots = torch.cat([_slots(ta, pos[:6]), _slots(tb, pos[6:])])
    chunks = [PrefillChunk(0, 6, 6, ta[:2]), PrefillChunk(6, 5, 5, tb[:2])]
    out = step(PagedStepLayout(slots, prefills=chunks), torch.cat([xa[:6], xb]), pos)
    outs.append(out[:6])
    pos = torch.arange(6, 9)
    outs.append(step(PagedStepLayout(_slots(ta, pos), prefills=[PrefillChunk(0, 3, 9, ta[:3])]),
                     xa[6:9], pos))
    for n in (9, 10):
        tables = torch.stack([ta, torch.cat([tb, tb[:1]])])[: 2 if n == 9 else 1]
        lens = torch.tensor([n + 1, 6])[:len(tables)]
        pos = lens - 1
        rows = torch.stack([xa[n], x[1, 5]])[:len(tables)]
        slots = torch.stack([_slots(t, p) for t, p in zip(tables, pos)])
        layout = PagedStepLayout(slots, num_decode_tokens=len(tables),
                                 decode_block_tables=tables, decode_context_lens=lens)
        outs.append(step(layout, rows, pos)[:1])
    return torch.cat(outs)


def _dense(layer, x, rope):
    cos, sin = rope.cos_sin(torch.arange(11), torch.float32)
    return layer(x[:1], cos, sin, DenseAttention(11, x.device))[0]


@torch.no_grad()
def test_absorbed_attention_over_the_latent_cache_equals_the_expanded_heads():
    layer, rope = _layer(), RotaryEmbedding(MLA.qk_rope_head_dim, 10000.0)
    x = torch.randn(2, 11, HIDDEN, generator=torch.Generator().manual_seed(1))
    cache = _cache()
    paged = _paged(layer, cache, x, rope)
    dense = _dense(layer, x, rope)
    assert paged.shape == dense.shape == (11, HIDDEN)
    assert (paged - dense).abs().max().item() <= 1e-5 * dense.abs().max().item()
    assert cache.v_cache.data_ptr() == cache.k_cache.data_ptr()   # the value: a view of the key
    assert cache.k_cache.shape == (BLOCKS, BLOCK, 1, WIDTH)


@torch.no_grad()
def test_int8_latent_cache_is_near_the_float_one():
    """One float16 scale per row (c_kv and k_rope together): every element within half an int8
    step of its value; measured 1.4% of the output's range here, bound 3%."""
    layer, rope = _layer(), RotaryEmbedding(MLA.qk_rope_head_dim, 10000.0)
    x = torch.randn(2, 11, HIDDEN, generator=torch.Generator().manual_seed(1))
    ref = _paged(layer, _cache(), x, rope)
    cache = _cache(torch.int8)
    out = _paged(layer, cache, x, rope)
    err = (out - ref).abs().max().item()
    assert 0 < err <= 0.03 * ref.abs().max().item(), err
    assert cache.k_cache.dtype == torch.int8 and cache.k_scales.shape == (BLOCKS, BLOCK, 1)


def test_backends_of_the_latent_cache():
    cpu = torch.device("cpu")
    assert resolve_attention_backend("kernel", cpu, False, 16, True, latent=True) == "kernel"
    assert resolve_attention_backend("auto", cpu, False, 16, True, latent=True) == "kernel"
    assert resolve_attention_backend("auto", cpu, False, 16, False, latent=True) == "gather"
    cuda = torch.device("cuda")                      # auto gathers the latent on CUDA too
    assert resolve_attention_backend("auto", cuda, False, 16, latent=True) == "gather"
    assert resolve_attention_backend("flex", cuda, False, 16, latent=True) == "flex"
    assert resolve_attention_backend("auto", cpu, False, 16, True) == "kernel"
