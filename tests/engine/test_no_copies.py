"""Performance by design: K/V are never copied once per query head, and the cache is never
reallocated or copied whole during a step. Checked by recording every tensor the step creates."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_helpers import GREEDY, engine
from kvslim.engine.sampling_params import SamplingParams


class RecordSizes(TorchDispatchMode):
    """Largest tensor created by an out-of-place op (in-place ops and views return their input)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, None)
        self.attention_kv_heads = []          # heads of the K given to each attention kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if "scaled_dot_product" in name and "backward" not in name:
            self.attention_kv_heads.append(args[1].shape[1])
        if not name.endswith("_") and "view" not in name and "alias" not in name:
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.numel() > self.largest[0] \
                        and t._base is None:
                    self.largest = (t.numel(), name)
        return out


def test_decode_reads_the_cache_without_per_head_copies(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"])                  # 8 query heads over 2 KV heads
    cache = eng.runner.kv_cache
    ptrs = [layer.data_ptr() for layer in cache]
    context = 200
    eng.add_request(list(range(1, context)), SamplingParams(max_tokens=4, **GREEDY))
    eng.step()                                           # prefill
    cfg = eng.model_config
    with RecordSizes() as rec:
        eng.step()                                       # one decode over ~200 cached tokens
    padded = -(-context // 16) * 16
    one_kv_copy = padded * cfg.num_key_value_heads * cfg.head_dim    # the gathered K (allowed)
    per_head_copy = padded * cfg.num_attention_heads * cfg.head_dim  # K repeated per query head
    assert rec.largest[0] < per_head_copy, rec.largest
    assert rec.largest[0] < sum(layer.numel() for layer in cache) // 100
    assert per_head_copy == 4 * one_kv_copy
    assert [layer.data_ptr() for layer in eng.runner.kv_cache] == ptrs   # never reallocated


def test_attention_kernels_get_kv_heads_not_query_heads(hf_checkpoints):
    # SDPA's calls (the gather path; the decode kernel takes the cache itself, KV heads only)
    eng = engine(hf_checkpoints["mqa"], block_size=8, attention_backend="gather")
    cfg = eng.model_config
    eng.add_request(list(range(1, 121)), SamplingParams(max_tokens=3, **GREEDY))
    eng.add_request(list(range(1, 41)) + [7, 8], SamplingParams(max_tokens=3, **GREEDY))
    with RecordSizes() as rec:
        while eng.has_unfinished_requests():             # fresh prefill, prefix-hit prefill,
            eng.step()                                   # decodes
    assert len(rec.attention_kv_heads) >= 3 * cfg.num_hidden_layers
    assert set(rec.attention_kv_heads) == {cfg.num_key_value_heads}
