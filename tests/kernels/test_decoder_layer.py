"""The native decoder layer and stack (kernels/decoder_layer.py): on the embedded model and on
Gemma 3 (q/k head norms, sandwich norms, GELU, sliding windows) every layer takes them, and
their greedy tokens and logprobs are the modules' bit for bit, alone and batched."""
import pytest

from kvslim import LLM, SamplingParams
from kvslim.kernels import decoder_layer, extension
from thread_counts import outputs_at_thread_counts

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


def test_the_native_stack_gives_the_layers_bits_at_each_thread_count(smollm2_gguf):
    """All layers in one call (NativeDecoderStack, one hold of the threads) against one call a
    layer, at one and two threads: the same tokens and logprobs."""
    llm = LLM(kv_cache_memory="64MiB", linear_activations="int8")
    model = llm.engine.model.model
    stack = model.native
    assert stack is not None and len(stack.layers) == len(model.layers)
    prompts = [list(range(200 + i, 230 + 11 * i)) for i in range(3)]

    def both() -> list:
        model.native = stack
        together = _answers(llm, prompts)
        model.native = None
        return [together, _answers(llm, prompts)]

    answers = outputs_at_thread_counts(both)
    assert answers[0][0] == answers[0][1] == answers[1][0] == answers[1][1]


def test_a_failing_stack_raises_its_check_and_the_threads_serve_the_next_call(smollm2_gguf):
    """A TORCH_CHECK inside the held threads comes back as the caller's error, and the next
    call runs (no thread is left waiting)."""
    llm = LLM(kv_cache_memory="64MiB", linear_activations="int8")
    model = llm.engine.model.model
    first = model.native.layers[0]
    heads = first.heads
    try:
        first.heads = heads + 1
        with pytest.raises(RuntimeError, match="do not fit the heads"):
            _answers(llm, [list(range(100, 120))])
    finally:
        first.heads = heads
    assert len(_answers(llm, [list(range(100, 120))])[0][0]) == 12


def test_gemma3_native_layers_and_stack_give_the_modules_bits(gemma3_quantized_dir):
    """Gemma 3's Q4_K_M blocks (Q4_K and Q6_K linears): its four sandwich norms (1 + w), q and k
    head norms, tanh GELU and local layers' windows and RoPE go through the same op; prompts
    past the 512-token window reach the local layers' windowed attention."""
    llm = LLM(str(gemma3_quantized_dir), kv_cache_memory="64MiB", linear_activations="int8")
    model = llm.engine.model.model
    layers, stack = model.layers, model.native
    natives = [layer.native for layer in layers]
    assert stack is not None and all(n is not None for n in natives)
    assert any(layer.is_sliding for layer in layers) and not all(layer.is_sliding for layer in layers)
    prompts = [list(range(1000 + i, 1040 + 13 * i)) for i in range(2)] + [list(range(2000, 2530))]
    together = _answers(llm, prompts)
    model.native = None
    per_layer = _answers(llm, prompts)
    for layer in layers:
        layer.native = None
    modules = _answers(llm, prompts)
    assert together == per_layer == modules
