"""grouped_sdpa: same result as attention with K/V repeated per query head, without the repeat."""
import pytest
import torch

from kvslim.attention.grouped import causal_mask, grouped_mask, grouped_sdpa


def reference(q, k, v, allowed, scale):
    """Textbook attention with K/V repeated per query head (what grouped_sdpa must avoid)."""
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("tq,tk", [(7, 7), (3, 10), (1, 13)])
def test_matches_repeated_kv_reference(heads, kv_heads, tq, tk):
    g = torch.Generator().manual_seed(heads * 100 + tq)
    q = torch.randn(2, tq, heads, 16, generator=g)
    k = torch.randn(2, tk, kv_heads, 16, generator=g)
    v = torch.randn(2, tk, kv_heads, 16, generator=g)
    allowed = causal_mask(tq, tk, q.device).expand(2, tq, tk).clone()
    allowed[1, -1, 0] = False                            # row-specific masking
    out = grouped_sdpa(q, k, v, grouped_mask(allowed, heads // kv_heads, q.dtype), 0.25)
    torch.testing.assert_close(out, reference(q, k, v, allowed, 0.25), atol=1e-5, rtol=1e-5)
    if tq == tk:
        plain = grouped_sdpa(q, k, v, None, 0.25)
        torch.testing.assert_close(
            plain, reference(q, k, v, causal_mask(tq, tk, q.device)[None].expand(2, tq, tk), 0.25),
            atol=1e-5, rtol=1e-5)


def test_sliding_window_mask():
    m = causal_mask(3, 6, torch.device("cpu"), sliding_window=2)
    assert m.int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_unmasked_queries_see_every_key(heads, kv_heads):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, heads, 16, generator=g)
    k = torch.randn(1, 9, kv_heads, 16, generator=g)
    v = torch.randn(1, 9, kv_heads, 16, generator=g)
    out = grouped_sdpa(q, k, v, None, 0.25, causal=False)
    everything = torch.ones(1, 1, 9, dtype=torch.bool)
    torch.testing.assert_close(out, reference(q, k, v, everything, 0.25), atol=1e-5, rtol=1e-5)
