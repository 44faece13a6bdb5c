"""`cuda_sparse_24`: the linears of a 2:4-pruned model as semi-structured sparse tensors on CUDA.
Which layers switch and what they compute is checked on any machine with the conversion
stubbed (a dense copy); on the CPU the option is refused by name; with a GPU of compute
capability 8.0+, torch's own conversion runs and the engine's greedy tokens are the dense
kernels' (at bfloat16, where near-ties may round the other way, most of them)."""
import pytest
import torch

from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import ConfigError
from kvslim.formats.loader import load_model
from kvslim.layers.cuda_sparse24 import Sparse24CudaKernel, use_semi_structured_24
from kvslim.layers.linear import Linear
from kvslim.surgery.prune.masks import SparsityTarget
from kvslim.surgery.prune.model import prune_model


@pytest.fixture(scope="module")
def pruned(hf_checkpoints, tmp_path_factory):
    return prune_model(hf_checkpoints["gqa"], tmp_path_factory.mktemp("p24") / "p24",
                       "magnitude", SparsityTarget(n=2, m=4), show_progress=False)


def test_every_2of4_linear_switches_and_computes_the_same(pruned):
    model = load_model(pruned, dtype=torch.float32, device="cpu")
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad():
        before = model.logits(ids)
        dense_2of4 = [n for n, m in model.named_modules() if isinstance(m, Linear)
                      and n.startswith("model.layers.")]
        converted = []
        count = use_semi_structured_24(model, to_sparse=lambda w: converted.append(w) or w.clone())
        after = model.logits(ids)
    switched = [n for n, m in model.named_modules()
                if isinstance(m, Linear) and isinstance(m.kernel, Sparse24CudaKernel)]
    assert switched == dense_2of4 and count == len(dense_2of4) == len(converted)
    assert all(model.get_submodule(n).weight.numel() == 0 for n in switched)
    assert model.lm_head.kernel is None                  # the head is not pruned
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_a_weight_the_format_refuses_keeps_its_dense_kernel(pruned):
    model = load_model(pruned, dtype=torch.float32, device="cpu")

    def refuse(w):
        raise RuntimeError("shape not supported")
    assert use_semi_structured_24(model, to_sparse=refuse) == 0
    assert all(m.kernel is None and m.weight.numel() > 0 for m in model.modules()
               if isinstance(m, Linear))


def test_without_cuda_the_option_is_refused_by_name(pruned):
    with pytest.raises(ConfigError, match="cuda_sparse_24 needs a CUDA device; the model is "
                                          "on cpu"):
        LLMEngine(pruned, EngineConfig(dtype="float32", device="cpu", kv_cache_memory="4MiB",
                                       cuda_sparse_24=True))


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU with sparse tensor cores")
def test_on_a_gpu_the_sparse_engine_decodes_the_dense_engines_tokens(pruned):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["It is a truth", "the kernel", "a b c d e f"]
    out = {}
    for sparse in (False, True):
        eng = LLMEngine(pruned, EngineConfig(dtype="bfloat16", device="cuda",
                                             kv_cache_memory="64MiB", cuda_sparse_24=sparse))
        if sparse:
            assert any(isinstance(m.kernel, Sparse24CudaKernel) for m in eng.model.modules()
                       if isinstance(m, Linear))
        ids = [eng.add_request(p, params) for p in prompts]
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        out[sparse] = [done[i].outputs[0].token_ids for i in ids]
    same = sum(a == b for a, b in zip(out[False], out[True]))
    assert same >= len(prompts) - 1, out
