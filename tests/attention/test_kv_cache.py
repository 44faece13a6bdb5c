"""The quantized KV cache: round trip per token and head, and paged attention over an int8 (and
fp8) cache against the same attention over the float cache, within stated bounds."""
import pytest
import torch

from kvslim.attention import (KVCacheLayer, PagedAttention, PagedStepLayout, PrefillChunk,
                              QuantizedKVCacheLayer, build_paged_metadata)
from kvslim.attention.kv_cache import dequantize, quantize

BLOCK, KVH, H, D, BLOCKS = 4, 2, 6, 16, 12


def test_int8_round_trip_is_within_half_a_step_per_row():
    x = torch.randn(50, KVH, D, generator=torch.Generator().manual_seed(0)) * 3
    q, s = quantize(x, torch.int8)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (50, KVH)
    err = (dequantize(q, s, torch.float32) - x).abs()
    assert (err <= s.float().unsqueeze(-1) / 2 + 1e-7).all()          # half an int8 step
    assert (q.abs().amax(-1) == 127).all()                          # the absmax row uses the range
    zeros = quantize(torch.zeros(3, KVH, D), torch.int8)
    assert (dequantize(*zeros, torch.float32) == 0).all()           # no division by a zero scale


def _caches(kv_dtype):
    shape = (BLOCKS, BLOCK, KVH)
    if kv_dtype is None:
        return KVCacheLayer(torch.zeros(*shape, D), torch.zeros(*shape, D))
    return QuantizedKVCacheLayer(torch.zeros(*shape, D, dtype=kv_dtype),
                                 torch.zeros(*shape, D, dtype=kv_dtype),
                                 torch.zeros(shape, dtype=torch.float16),
                                 torch.zeros(shape, dtype=torch.float16), torch.float32)


def _prefill_then_decode(cache, q, k, v, table):
    """A 9-token prompt in one chunk, then 2 more tokens decoded one by one over the cache."""
    outs = []
    for start, n in ((0, 9), (9, 1), (10, 1)):
        pos = torch.arange(start, start + n)
        slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
        if start == 0:
            layout = PagedStepLayout(slot_mapping=slots, prefills=[PrefillChunk(
                0, n, n, table[:-(-n // BLOCK)])])
        else:
            layout = PagedStepLayout(slot_mapping=slots, num_decode_tokens=1,
                                     decode_block_tables=table[None, :start // BLOCK + 1],
                                     decode_context_lens=torch.tensor([start + 1]))
        attn = PagedAttention([cache], build_paged_metadata(layout, BLOCK))
        outs.append(attn.attend(0, q[pos], k[pos], v[pos], D ** -0.5))
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype, bound", [(torch.int8, 0.02), (torch.float8_e4m3fn, 0.08)])
def test_quantized_attention_matches_float_attention(kv_dtype, bound):
    """Bound: max |out_q - out_f| <= bound * max |V|. int8 stores each element within half a
    step (absmax/254) of its value; fp8 e4m3 within 2^-4 of it relative."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(11, n, D, generator=g) for n in (H, KVH, KVH))
    table = torch.tensor([5, 2, 9])
    ref = _prefill_then_decode(_caches(None), q, k, v, table)
    out = _prefill_then_decode(_caches(kv_dtype), q, k, v, table)
    err = (out - ref).abs().max().item()
    assert err <= bound * v.abs().max().item(), err
    assert err > 0                                      # it really went through the int8 path
