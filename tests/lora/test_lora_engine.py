"""LoRA adapters in the engine, against transformers + peft (the adapter merged): each adapter's
greedy tokens in one batch that mixes the base model and two adapters of different ranks, on a
dense and a GQA checkpoint; base rows unchanged by their neighbours; rsLoRA and a q/v-only
adapter; the prefix cache keyed by adapter; host-cache LRU eviction; refusals in one line."""
import pytest

from engine.engine_helpers import engine, prompts_of, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError, KvslimError
from kvslim.lora.request import LoRARequest
from lora.peft_adapters import merged_greedy, write_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(hf_checkpoints, tmp_path_factory):
    """checkpoint variant -> {name: LoRARequest}: rank 8 on every linear, rank 4 on q/v only
    with rsLoRA."""
    out = {}
    for i, variant in enumerate(("mha", "gqa")):
        root = tmp_path_factory.mktemp(f"lora-{variant}")
        ckpt = hf_checkpoints[variant]
        wide = write_adapter(ckpt, root / "wide", r=8, alpha=16, seed=1)
        narrow = write_adapter(ckpt, root / "narrow", r=4, alpha=8, seed=2,
                               targets=["q_proj", "v_proj"], use_rslora=True)
        out[variant] = {"wide": LoRARequest("wide", 1, str(wide)),
                        "narrow": LoRARequest("narrow", 2, str(narrow))}
    return out


def lora_engine(path, **config):
    return engine(path, enable_lora=True, max_loras=2, max_lora_rank=8, **config)


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_a_mixed_batch_equals_peft_merged_per_adapter(hf_checkpoints, adapters, variant):
    ckpt, loras = hf_checkpoints[variant], adapters[variant]
    prompts = prompts_of([7, 12, 5, 9, 16, 6], seed=3)
    chosen = [None, loras["wide"], loras["narrow"], loras["wide"], None, loras["narrow"]]
    eng = lora_engine(ckpt)
    ids = [eng.add_request(p, GREEDY, lora_request=lora) for p, lora in zip(prompts, chosen)]
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    got = [done[i].outputs[0].token_ids for i in ids]
    for name in (None, "wide", "narrow"):
        rows = [i for i, lora in enumerate(chosen) if (lora and lora.lora_name) == name]
        expected = merged_greedy(ckpt, loras[name].lora_path if name else None,
                                 [prompts[i] for i in rows], 10)
        assert [got[i] for i in rows] == expected, name
    assert eng.kv_cache_stats().num_used_blocks == 0 and not eng.lora.live


def test_base_rows_are_bit_identical_to_an_engine_without_adapters(hf_checkpoints, adapters):
    ckpt, loras = hf_checkpoints["gqa"], adapters["gqa"]
    prompts = prompts_of([9, 14, 6, 11], seed=4)
    plain = run(engine(ckpt), prompts, GREEDY)
    eng = lora_engine(ckpt)
    ids = [eng.add_request(p, GREEDY, lora_request=lora)
           for p, lora in zip(prompts, [None, loras["wide"], None, loras["narrow"]])]
    while eng.has_unfinished_requests():
        finished = {o.request_id: o for o in eng.step() if o.finished}
        for k, i in enumerate(ids):
            if i in finished and k in (0, 2):
                assert finished[i].outputs[0].token_ids == plain[k].outputs[0].token_ids


def run_lora(eng, prompts, loras, params=GREEDY):
    """Each prompt's finished output (in order), run together with its LoRARequest (or None)."""
    ids = [eng.add_request(p, params, lora_request=lora) for p, lora in zip(prompts, loras)]
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert eng.kv_cache_stats().num_used_blocks == 0
    return [done[i] for i in ids]


def test_an_adapters_rows_do_not_depend_on_the_batch(hf_checkpoints, adapters):
    ckpt, loras = hf_checkpoints["gqa"], adapters["gqa"]
    prompts = prompts_of([8, 13, 5, 10, 7], seed=5)
    eng = lora_engine(ckpt)
    alone = [tokens(run_lora(eng, [p], [loras["wide"]]))[0] for p in prompts[:3]]
    mixed = tokens(run_lora(eng, prompts, [loras["wide"]] * 3 + [None, loras["narrow"]]))
    assert mixed[:3] == alone
    assert alone != tokens(run(eng, prompts[:3], GREEDY))                # the adapter acts


def test_the_prefix_cache_is_keyed_by_adapter(hf_checkpoints, adapters):
    ckpt, wide = hf_checkpoints["gqa"], adapters["gqa"]["wide"]
    prompt = prompts_of([40], seed=6)
    eng = lora_engine(ckpt, block_size=4)
    cached = [run_lora(eng, prompt, [lora])[0].metrics.num_cached_tokens
              for lora in (None, wide, wide, None)]
    assert cached[0] == 0 and cached[1] == 0            # the base's blocks are not the adapter's
    assert cached[2] > 0 and cached[3] > 0              # each hits its own


def test_the_host_cache_drops_the_least_recently_used_adapter(hf_checkpoints, adapters,
                                                              tmp_path):
    ckpt, loras = hf_checkpoints["gqa"], adapters["gqa"]
    third = LoRARequest("third", 3, str(write_adapter(ckpt, tmp_path / "third", r=2, seed=7)))
    eng = engine(ckpt, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    prompt = prompts_of([6], seed=8)
    first = tokens(run_lora(eng, prompt, [loras["wide"]]))
    for lora in (loras["narrow"], third):
        run_lora(eng, prompt, [lora])
    assert list(eng.lora.adapters) == [2, 3]              # "wide", used longest ago, dropped
    loads = eng.lora.loads
    assert tokens(run_lora(eng, prompt, [loras["wide"]])) == first     # read again, same tokens
    assert list(eng.lora.adapters) == [3, 1] and eng.lora.loads == loads + 1


def test_more_adapters_than_slots_wait_their_turn(hf_checkpoints, adapters):
    ckpt, loras = hf_checkpoints["gqa"], adapters["gqa"]
    prompts = prompts_of([6, 9, 7], seed=9)
    chosen = [loras["wide"], loras["narrow"], loras["wide"]]
    one_slot = engine(ckpt, enable_lora=True, max_loras=1, max_lora_rank=8)
    two_slots = lora_engine(ckpt)
    assert tokens(run_lora(one_slot, prompts, chosen)) == tokens(
        run_lora(two_slots, prompts, chosen))
    assert one_slot.lora.loads >= 2


def _refused(eng, request, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        eng.add_request([5, 6, 7], GREEDY, lora_request=request)
    assert e.value.param == "lora_request" and not eng.has_unfinished_requests()
    assert request.lora_int_id not in eng.lora.adapters


def test_what_kvslim_does_not_run_is_refused_in_one_line(hf_checkpoints, adapters, tmp_path):
    ckpt = hf_checkpoints["gqa"]
    eng = lora_engine(ckpt)
    big = write_adapter(ckpt, tmp_path / "big", r=16, seed=3)
    _refused(eng, LoRARequest("big", 5, str(big)), r"rank 16 of model.layers.0.* is above max_lora_rank \(8\)")
    dora = write_adapter(ckpt, tmp_path / "dora", r=4, use_dora=True, targets=["q_proj"])
    _refused(eng, LoRARequest("dora", 6, str(dora)), "DoRA adapters are not supported")
    head = write_adapter(ckpt, tmp_path / "head", r=4, targets=["lm_head"])
    _refused(eng, LoRARequest("head", 7, str(head)), r"module lm_head is not one kvslim runs")
    embed = write_adapter(ckpt, tmp_path / "embed", r=4, targets=["embed_tokens"])
    _refused(eng, LoRARequest("embed", 8, str(embed)), "embedding adapters")
    _refused(eng, LoRARequest("none", 9, str(tmp_path / "missing")), "no adapter_config.json")
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is already adapter 'wide'"):
        eng.add_request([5, 6], GREEDY, lora_request=adapters["gqa"]["wide"])
        eng.add_request([5, 6], GREEDY, lora_request=LoRARequest("other", 1, str(big)))
    plain = engine(ckpt)
    with pytest.raises(InvalidRequestError, match="need an engine started with enable_lora"):
        plain.add_request([5, 6], GREEDY, lora_request=adapters["gqa"]["wide"])


@pytest.mark.parametrize("options, match", [
    (dict(speculative={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(max_loras=0), "max_loras must be positive"),
    (dict(max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be at least max_loras")])
def test_engine_options_that_cannot_run_adapters_are_refused(options, match):
    from kvslim.engine.config import EngineConfig
    with pytest.raises(KvslimError, match=match):
        EngineConfig(enable_lora=True, **options)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_adapters_on_a_4bit_base_add_in_float_beside_its_kernel(hf_checkpoints, tmp_path,
                                                                 activations):
    """AWQ 4-bit base layers: with float32 activations (the exact reference of the dequantized
    weight) the tokens equal transformers + peft merged into the dequantized weights; with
    int8 activations (llama.cpp's arithmetic, its own bound) an adapter's rows still do not
    depend on the batch, and the base rows are the quantized model's."""
    from quantized_checkpoints import write_awq
    quantized, float_twin, _ = write_awq(hf_checkpoints["gqa"], tmp_path / "awq")
    adapter = LoRARequest("q4", 1, str(write_adapter(float_twin, tmp_path / "a", r=8, seed=11)))
    prompts = prompts_of([7, 11, 9], seed=12)
    eng = lora_engine(quantized, linear_activations=activations)
    mixed = tokens(run_lora(eng, prompts, [adapter, None, adapter]))
    if activations == "float32":
        assert [mixed[0], mixed[2]] == merged_greedy(float_twin, adapter.lora_path,
                                                     [prompts[0], prompts[2]], 10)
        assert [mixed[1]] == merged_greedy(float_twin, None, [prompts[1]], 10)
    else:
        alone = [tokens(run_lora(eng, [p], [adapter]))[0] for p in (prompts[0], prompts[2])]
        assert [mixed[0], mixed[2]] == alone
        base = engine(quantized, linear_activations=activations)
        assert mixed[1] == tokens(run(base, [prompts[1]], GREEDY))[0]


def test_structured_outputs_bind_an_adapters_answer_too(hf_checkpoints, adapters):
    import json
    wide = adapters["gqa"]["wide"]
    eng = lora_engine(hf_checkpoints["gqa"])
    params = SamplingParams(max_tokens=30, temperature=0.0,
                            structured_outputs={"json_object": True})
    outs = run_lora(eng, prompts_of([6, 9], seed=13), [wide, None], params)
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in outs)


def test_native_layers_add_adapters_with_the_modules_bits(hf_checkpoints, adapters, tmp_path,
                                                          monkeypatch):
    """A 4-bit model with int8 activations runs each decoder layer as one native call: it adds
    the adapters inside, and its tokens and logprobs are the modules' to the bit."""
    from quantized_checkpoints import write_awq
    quantized, _, _ = write_awq(hf_checkpoints["gqa"], tmp_path / "awq")
    loras = adapters["gqa"]
    prompts = prompts_of([7, 11, 9, 5], seed=14)
    chosen = [loras["wide"], None, loras["narrow"], loras["wide"]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    eng = lora_engine(quantized)
    model = eng.model.model
    assert model.native is not None and all(layer.native.lora for layer in model.layers)
    calls = []
    stack_call = type(model.native).__call__
    monkeypatch.setattr(type(model.native), "__call__",
                        lambda self, *a: calls.append(1) or stack_call(self, *a))
    plain = tokens(run_lora(eng, prompts[:1], [None], params))
    native = run_lora(eng, prompts, chosen, params)
    assert calls and tokens(native)[0] != plain[0]                  # native, and the adapter acts
    for owner in (*model.layers, model):
        owner.native = None
    modules = run_lora(eng, prompts, chosen, params)
    for a, b in zip(native, modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_fused_projection_adapter_trains_every_shard(hf_checkpoints, tmp_path):
    """Phi-3's checkpoints fuse q/k/v and gate/up: an adapter on qkv_proj and gate_up_proj
    spans all their shards."""
    ckpt = hf_checkpoints["phi3"]
    fused = write_adapter(ckpt, tmp_path / "fused", r=4, seed=15,
                          targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    prompts = prompts_of([7, 10], seed=16)
    got = tokens(run_lora(lora_engine(ckpt), prompts, [LoRARequest("fused", 1, str(fused))] * 2))
    assert got == merged_greedy(ckpt, fused, prompts, 10)
