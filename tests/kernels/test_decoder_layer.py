"""The native decoder layer (kernels/decoder_layer.py): on the embedded model every layer takes
it, and its greedy tokens and logprobs are the modules' bit for bit, alone and batched."""
import pytest

from kvslim import LLM, SamplingParams
from kvslim.kernels import decoder_layer, extension

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")


def _answers(llm, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [repr(d) for d in o.outputs[0].logprobs]) for o in outs]


def test_the_native_layer_gives_the_modules_bits(smollm2_gguf):
    assert decoder_layer.available(), extension.load()
    llm = LLM(kv_cache_memory="64MiB", linear_activations="int8")          # the shipped Q4_1 blocks
    layers = llm.engine.model.model.layers
    natives = [layer.native for layer in layers]
    assert all(n is not None for n in natives)
    prompts = [list(range(100 + i, 140 + 9 * i)) for i in range(3)]
    native = _answers(llm, prompts)
    alone = [_answers(llm, [p])[0] for p in prompts]
    for layer in layers:
        layer.native = None
    modules = _answers(llm, prompts)
    assert native == modules
    assert alone == native
