"""A 2:4-pruned float model runs kvslim's 2:4 kernel in every decoder linear (the other layers,
and an unstructured 50% model, keep the tiled kernel): greedy tokens equal transformers' and do
not depend on what else is in the batch."""
import pytest
import torch

from engine.engine_helpers import GREEDY, engine, prompts_of, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.kernels import tiled_gemm
from kvslim.layers.cpu_linear import Sparse24CpuKernel, TiledCpuKernel, is_two_of_four
from kvslim.layers.linear import Linear
from kvslim.surgery.prune.masks import SparsityTarget
from kvslim.surgery.prune.model import prune_model

pytestmark = pytest.mark.skipif(not tiled_gemm.available(), reason="kvslim's kernels not built")


def kernels(eng):
    return {name: type(m.kernel) for name, m in eng.model.named_modules()
            if isinstance(m, Linear) and m.kernel is not None}


def test_two_of_four_is_recognised_exactly():
    w = torch.zeros(3, 8)
    w[:, [0, 3, 5, 6]] = 1.0
    assert is_two_of_four(w)
    w[2, 1] = 1.0                                     # a third nonzero in one group
    assert not is_two_of_four(w)
    assert not is_two_of_four(torch.zeros(2, 6))      # not whole groups of four


def test_a_2of4_model_runs_the_sparse_kernel_with_hf_greedy_tokens(hf_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM
    src = hf_checkpoints["gqa"]
    pruned = prune_model(src, tmp_path / "p24", "magnitude", SparsityTarget(n=2, m=4),
                         show_progress=False)
    eng = engine(pruned)
    used = kernels(eng)
    decoder = {n: k for n, k in used.items() if n.startswith("model.layers.")}
    assert decoder and set(decoder.values()) == {Sparse24CpuKernel}
    assert {k for n, k in used.items() if n not in decoder} <= {TiledCpuKernel}
    prompts = prompts_of([5, 9, 3, 12], seed=3)
    params = SamplingParams(max_tokens=10, **GREEDY)
    batched = tokens(run(eng, prompts, params))
    alone = [tokens(run(eng, [p], params))[0] for p in prompts]
    assert batched == alone
    hf = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.float32).eval()
    for p, ours in zip(prompts, batched):
        ids = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                          min_new_tokens=10)[0, len(p):].tolist()
        assert ours == ids


def test_an_unstructured_model_keeps_the_tiled_kernel(hf_checkpoints, tmp_path):
    pruned = prune_model(hf_checkpoints["gqa"], tmp_path / "p50", "magnitude",
                         SparsityTarget(sparsity=0.5), show_progress=False)
    assert set(kernels(engine(pruned)).values()) == {TiledCpuKernel}
