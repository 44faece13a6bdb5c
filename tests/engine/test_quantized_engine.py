"""Quantized models (GPTQ 4-bit, W8A8) through the paged engine: greedy tokens do not depend on
which requests share a batch, nor on prefix-cache hits, and match the dense forward pass."""
import pytest
import torch

from checkpoints import VOCAB
from engine_helpers import GREEDY, engine, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.formats.loader import load_model
from kvslim.kernels import extension, group_q8, tiled_gemm
from kvslim.quantization import QuantSpec
from kvslim.quantization.w8a8 import W8A8_SPEC
from kvslim.surgery.quantize.model import quantize_model

PARAMS = SamplingParams(max_tokens=12, **GREEDY)


def prompts(lengths, seed, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["gptq-4bit", "w8a8"])
def quantized(request, hf_checkpoints, tmp_path_factory):
    method, spec = (("w8a8", W8A8_SPEC) if request.param == "w8a8" else
                    ("rtn", QuantSpec(4, 32, sym=False, checkpoint_format="gptq_v2")))
    return quantize_model(hf_checkpoints["gqa"], tmp_path_factory.mktemp("q") / request.param,
                          method, spec, show_progress=False)


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_batch_composition_does_not_change_tokens(quantized, activations):
    """In both kinds of activations; float32's (the exact reference) are also the dense pass's
    tokens (int8 rounds the activations as llama.cpp does: close, not equal)."""
    batch = prompts([5, 23, 1, 40, 12], seed=0)
    together = tokens(run(engine(quantized, linear_activations=activations), batch, PARAMS))
    eng = engine(quantized, linear_activations=activations)
    alone = [tokens(run(eng, [p], PARAMS))[0] for p in batch]
    small_steps = tokens(run(engine(quantized, max_num_seqs=2, max_num_batched_tokens=16,
                                    linear_activations=activations), batch, PARAMS))
    assert together == alone == small_steps
    if activations == "float32" or quantized.name == "w8a8":
        dense = dense_greedy(load_model(quantized, dtype=torch.float32), batch[1], 12)
        assert together[1] == dense


@torch.no_grad()
def dense_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_prefix_cache_does_not_change_tokens(quantized):
    shared = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = prompts([3, 9, 6], seed=1, prefix=shared)
    eng = engine(quantized, enable_prefix_caching=True)
    first = tokens(run(eng, batch[:1], PARAMS))
    cached = tokens(run(eng, batch, PARAMS))            # the shared blocks are hits now
    uncached = tokens(run(engine(quantized, enable_prefix_caching=False), batch, PARAMS))
    assert first[0] == cached[0]
    assert cached == uncached


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A GGUF model kept quantized with Q4_K, Q4_1, Q6_K, Q8_0 and Q4_0 linears (q/k/v of three
    types in one layer) and a Q8_0 tied embedding table."""
    from gguf import GGMLQuantizationType as Q
    from gguf_files import write_tiny_gguf
    from kvslim.formats.gguf.importer import import_gguf
    root = tmp_path_factory.mktemp("mixed")
    types = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_1, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
             "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0}
    write_tiny_gguf(root / "mixed.gguf", types=types, hidden=256, ffn=256, tied=True)
    return str(import_gguf(root / "mixed.gguf", root / "kept", show_progress=False,
                           keep_quantized=True))


def test_mixed_gguf_greedy_does_not_depend_on_batch_or_prefix_cache(mixed_gguf):
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 260, (40,), generator=g).tolist()
    batch = [shared + torch.randint(3, 260, (n,), generator=g).tolist() for n in (3, 11, 1)]
    batch.append(torch.randint(3, 260, (7,), generator=g).tolist())
    together = tokens(run(engine(mixed_gguf, enable_prefix_caching=False), batch, PARAMS))
    alone = [tokens(run(engine(mixed_gguf, enable_prefix_caching=False), [p], PARAMS))[0]
             for p in batch]
    small = tokens(run(engine(mixed_gguf, max_num_seqs=2, max_num_batched_tokens=16,
                              enable_prefix_caching=False), batch, PARAMS))
    cached_engine = engine(mixed_gguf, enable_prefix_caching=True)
    run(cached_engine, batch[:1], PARAMS)
    cached = tokens(run(cached_engine, batch, PARAMS))         # the shared blocks are hits now
    assert together == alone == small == cached
    assert len({tuple(t) for t in together}) > 1               # not one constant answer


@pytest.mark.skipif(extension.disabled() or extension.missing_compiler() is not None,
                    reason="torch's fallback kernels are not batch-invariant (gguf_blocks.py)")
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_mixed_gguf_logprobs_are_bit_identical_batched_and_alone(mixed_gguf, activations):
    """kvslim's group kernels fix each row's arithmetic: not only the tokens, every logit of
    every step is the same whatever else the batch holds (float32 activations or int8 ones)."""
    assert tiled_gemm.available(), extension.load()
    if activations == "int8" and not group_q8.available():
        pytest.skip("this CPU has no AVX-512 VNNI: int8 activations fall back to float32")
    params = SamplingParams(max_tokens=10, logprobs=0, **GREEDY)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 260, (n,), generator=g).tolist() for n in (9, 30, 2, 17, 5)]
    options = dict(enable_prefix_caching=False, linear_activations=activations)
    together = run(engine(mixed_gguf, **options), batch, params)
    eng = engine(mixed_gguf, **options)
    alone = [run(eng, [p], params)[0] for p in batch]
    assert [[lp.logprob for lp in o.outputs[0].logprobs] for o in together] == \
        [[lp.logprob for lp in o.outputs[0].logprobs] for o in alone]


def _group_weights(model) -> list:
    """Every group-kernel weight the model's layers hold (4-bit ones inside Int4Weight)."""
    found = []
    for module in model.modules():
        for kernel in getattr(getattr(module, "kernel", None), "keywords", {}).values():
            weight = getattr(kernel, "group", kernel)
            if isinstance(weight, (tiled_gemm.GroupWeight, group_q8.Q8GroupWeight)):
                found.append(weight)
    return found


@pytest.mark.skipif(extension.disabled() or extension.missing_compiler() is not None,
                    reason="the int8-activation kernel is part of kvslim's extension")
def test_int8_activations_run_the_int8_kernel_close_to_float32(mixed_gguf):
    """linear_activations="int8" packs every group layer for the VNNI kernel (4- and 8-bit),
    and its prompt logprobs stay near float32 activations' (llama.cpp's rounding of x; its
    effect on a real model's perplexity: benchmarks/model_ppl.py --linear-activations)."""
    if not group_q8.available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
    prompt = torch.randint(3, 260, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    out = {}
    for activations in ("float32", "int8"):
        eng = engine(mixed_gguf, enable_prefix_caching=False, linear_activations=activations)
        kinds = {type(w) for w in _group_weights(eng.model)}
        assert kinds == {group_q8.Q8GroupWeight if activations == "int8"
                         else tiled_gemm.GroupWeight}, kinds
        out[activations] = [lp.logprob
                            for lp in run(eng, [prompt], params)[0].prompt_logprobs[1:]]
    # the random model's logprobs are tens of nats: the rounding of x moves them by percents
    ref = torch.tensor(out["float32"])
    rel = (torch.tensor(out["int8"]) - ref).abs() / ref.abs()
    assert 0 < rel.max() < 0.05, rel
