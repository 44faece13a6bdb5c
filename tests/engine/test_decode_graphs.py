"""The decode-graph path (what CUDA graphs record and replay): padded batches read from static
buffers, every padded shape prepared at start-up. Run eagerly here, it must give HF's greedy
tokens, run only prepared shapes, write padding rows only into the reserved block, and leave no
block in use."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VOCAB
from engine_helpers import GREEDY, engine, hf_greedy, run, tokens
from kvslim.attention import KVCacheLayer
from kvslim.engine.decode_graphs import DecodeGraphs, capture_batch_sizes
from kvslim.engine.sampling_params import SamplingParams

LENGTHS = [3, 17, 40, 5, 33, 1, 20, 9, 12]
NEW = [20, 6, 14, 3, 9, 17, 11, 2, 8]          # the decode batch shrinks 9 -> 1 step by step


def test_capture_sizes_and_padding_shapes():
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    layer = KVCacheLayer(torch.zeros(4, 16, 1, 8), torch.zeros(4, 16, 1, 8))
    graphs = DecodeGraphs(None, [layer], 48,
                          max_num_seqs=6, max_blocks_per_seq=10, layer_windows=[None],
                          use_graphs=False)
    assert graphs.widths == [4, 10]                # gather: widths 4x apart, then the table's
    assert graphs.graphs == {}                     # nothing before prepare()
    assert graphs.shape_for(3, 3) == (4, 4)
    assert graphs.shape_for(1, 5) == (1, 10)
    assert graphs.shape_for(5, 9) == (6, 10)      # width capped at the table's
    assert graphs.shape_for(7, 1) is None          # more sequences than any padded batch
    assert graphs.shape_for(1, 11) is None


@pytest.mark.parametrize("variant", ["gqa", "mqa", "head_dim"])
def test_padded_decode_matches_transformers(hf_checkpoints, variant, monkeypatch):
    path = hf_checkpoints[variant]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [hf_greedy(hf, [p], n)[0] for p, n in zip(prompts, NEW)]
    eng = engine(path, max_num_seqs=12)
    eng.runner.enable_padded_decode()
    prepared = dict(eng.runner.decode_graphs.graphs)       # at start-up: every padded shape
    widths = eng.runner.decode_graphs.widths
    assert set(prepared) == {(b, w) for b in capture_batch_sizes(12) for w in widths}
    shapes = []
    forward = DecodeGraphs._forward
    monkeypatch.setattr(DecodeGraphs, "_forward",
                        lambda self, b, w: shapes.append((b, w)) or forward(self, b, w))
    reserved = [layer[:, eng.runner.num_blocks] for layer in eng.runner.kv_cache]   # views
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in NEW]
    assert tokens(run(eng, prompts, params)) == refs
    assert {b for b, _ in shapes} >= {12, 8, 4, 2, 1}     # padded batches did run
    assert set(shapes) <= set(prepared) and eng.runner.decode_graphs.graphs == prepared
    assert sum(r.abs().sum() for r in reserved) > 0   # padding rows wrote there, not live blocks
