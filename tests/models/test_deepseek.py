"""DeepSeek-V2/V3 (latent attention, DeepSeek's MoE) against transformers 5.23 on the random
checkpoints of tests/checkpoints.py (deepseek_v2: q_proj, group-limited routing; its q_lora
twin: greedy routing, two shared experts; deepseek_v3: noaux_tc, YaRN with mscale_all_dim).
Dense logits and dense greedy decoding are checked for every variant by test_parity.py; here:
the paged engine over its latent cache (one row of kv_lora_rank + qk_rope_head_dim per token and
layer, attention/latent_cache.py; the absorbed attention itself: tests/attention/
test_latent_cache.py) against generate, the cache's size against the planner's, an int8 latent
cache, a kvslim-written checkpoint, the config fields and what is refused."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from checkpoints import VOCAB, hf_config
from engine.engine_helpers import (GREEDY, NO_KERNELS, engine, hf_greedy, needs_kernels,
                                   prompts_of, run, tokens)
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import ConfigError
from kvslim.formats.info import count_parameters
from kvslim.formats.loader import load_model
from kvslim.formats.writer import save_model
from kvslim.models.config import ModelConfig
from kvslim.models.deepseek_v2 import attention_scale
from kvslim.plan.memory import plan_memory
from kvslim.plan.parameters import parameter_counts
from kvslim.plan.published import builtin_config

DEEPSEEK = ["deepseek_v2", "deepseek_v2_q_lora", "deepseek_v3"]
LENGTHS = [3, 17, 40, 5, 33, 1]
NEW = 16
PARAMS = SamplingParams(max_tokens=NEW, **GREEDY)


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=DEEPSEEK)
def case(request, hf_checkpoints):
    path = hf_checkpoints[request.param]
    prompts = prompts_of(LENGTHS)
    return path, prompts, hf_greedy(hf_model(path), prompts, NEW)


def test_engine_batched_matches_generate(case):
    path, prompts, refs = case
    assert tokens(run(engine(path), prompts, PARAMS)) == refs


def test_engine_alone_and_chunked_prefill_match_generate(case):
    path, prompts, refs = case
    eng = engine(path)
    assert [tokens(run(eng, [p], PARAMS))[0] for p in prompts] == refs
    assert tokens(run(engine(path, max_num_batched_tokens=16), prompts, PARAMS)) == refs


@pytest.mark.parametrize("variant", DEEPSEEK)
def test_engine_prefix_cache_and_preemption_keep_outputs(hf_checkpoints, variant):
    path = hf_checkpoints[variant]
    shared = prompts_of([4, 11, 7], seed=1, prefix=prompts_of([40], seed=2)[0])
    refs = hf_greedy(hf_model(path), shared, NEW)
    eng = engine(path, block_size=8)
    assert tokens(run(eng, shared[:1], PARAMS) + run(eng, shared[1:], PARAMS)) == refs
    assert eng.kv_cache_stats().prefix_cache_hits > 0
    per_token = eng.kv_cache_stats().bytes_per_token
    small = engine(path, kv_cache_memory=96 * per_token, block_size=8)
    assert tokens(run(small, shared, PARAMS)) == refs
    assert small.kv_cache_stats().num_preemptions > 0


@pytest.mark.parametrize("variant", DEEPSEEK)
def test_engine_caches_the_latent_the_planner_prices(hf_checkpoints, variant):
    """One row per token and layer, [c_kv; k_rope] = 32 + 8 float32 elements, no heads (the
    expanded heads took layers x 4 heads x 2 x 24): the cache tensors' bytes are the
    planner's per-token bytes (`kvslim memory`) times the tokens they hold. Parameter counts
    agree with the checkpoint."""
    path = hf_checkpoints[variant]
    config = ModelConfig.from_dir(path)
    layers, width = config.num_hidden_layers, 32 + 8
    eng = engine(path)
    runner, stats = eng.runner, eng.kv_cache_stats()
    assert config.kv_elements_per_token() == layers * width
    assert stats.bytes_per_token == config.kv_cache_bytes_per_token(torch.float32) == \
        layers * width * 4
    assert {t.shape for t in runner.kv_cache} == {(1, runner.num_blocks, 16, 1, width)}
    planned = plan_memory(config, kv_dtype="float32").kv_bytes_per_token
    held = sum(t.numel() * t.element_size() for t in runner.kv_cache)
    assert held == planned * runner.num_blocks * runner.block_size == planned * stats.max_tokens
    assert plan_memory(config, kv_dtype="fp16").kv_bytes_per_token == layers * width * 2
    assert parameter_counts(config)[0] == count_parameters(path, config)


def test_deepseek_v2_latent_cache_bytes():
    """Real DeepSeek-V2 in bfloat16: 60 layers x (512 + 64) x 2 bytes per token, where the
    expanded heads took 60 x 128 heads x 2 x 192 x 2 (85.3x as much)."""
    config = builtin_config("DeepSeek-V2")
    assert config.kv_cache_bytes_per_token(torch.bfloat16) == 60 * 576 * 2 == 69_120
    assert config.kv_cache_bytes_per_token("int8") == 60 * (576 + 2)
    assert config.kv_elements_per_token(num_kv_heads=128) == 60 * 128 * (192 + 128)


@pytest.mark.parametrize("variant", DEEPSEEK)
def test_int8_latent_cache(hf_checkpoints, variant):
    """One int8 row and one float16 scale per token and layer: greedy tokens independent of
    batching, chunking and prefix-cache hits (fresh rows are attended as they are read
    back), prompt logprobs near the float cache's: within 0.5, 0.05 on average (measured: up to
    0.30, 0.031 on average, deepseek_v3; looser than the dense models' bound, as a router's
    top-k may flip at a near-tie; a scale for c_kv and one for k_rope measured the same on
    deepseek_v2, so the row keeps one)."""
    path = hf_checkpoints[variant]
    layers = ModelConfig.from_dir(path).num_hidden_layers
    prompts = prompts_of([3, 17, 40]) + prompts_of([4, 11], seed=1, prefix=prompts_of([24])[0])
    eng = engine(path, kv_cache_dtype="int8", block_size=8)
    assert eng.kv_cache_stats().bytes_per_token == layers * (40 + 2)
    alone = [tokens(run(eng, [p], PARAMS))[0] for p in prompts]
    assert eng.kv_cache_stats().prefix_cache_hits > 0
    chunked = engine(path, kv_cache_dtype="int8", max_num_batched_tokens=16)
    assert tokens(run(chunked, prompts, PARAMS)) == alone
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
    outs = {d: run(engine(path, kv_cache_dtype=d), prompts[2:3], scored) for d in ("auto", "int8")}
    lf, lq = (torch.tensor([t.logprob for t in outs[d][0].prompt_logprobs[1:]])
              for d in ("auto", "int8"))
    assert 0 < (lf - lq).abs().max() <= 0.5 and (lf - lq).abs().mean() <= 0.05


def test_flex_and_the_kernel_read_the_latent_cache(hf_checkpoints):
    path = hf_checkpoints["deepseek_v2"]
    prompts = prompts_of([3, 17])
    refs = hf_greedy(hf_model(path), prompts, 4)
    few = SamplingParams(max_tokens=4, **GREEDY)
    assert tokens(run(engine(path, attention_backend="flex"), prompts, few)) == refs
    if not NO_KERNELS:                       # the kernel backend needs the extension
        assert tokens(run(engine(path, attention_backend="kernel"), prompts, few)) == refs


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_kernel_over_the_latent_cache_is_batch_invariant(case, kv_cache_dtype):
    """Every token through the C++ kernel (one KV head, the value a view of the key): a
    prompt's logprobs alone, batched and chunked are the same to the last bit."""
    path, prompts, expected = case
    scored = SamplingParams(max_tokens=NEW, logprobs=0, **GREEDY)
    eng = engine(path, attention_backend="kernel", kv_cache_dtype=kv_cache_dtype)
    alone = [run(eng, [p], scored)[0] for p in prompts]
    batched = run(engine(path, attention_backend="kernel", kv_cache_dtype=kv_cache_dtype,
                         max_num_batched_tokens=16), prompts, scored)
    logprobs = [[lp.logprob for lp in o.outputs[0].logprobs] for o in alone]
    assert [[lp.logprob for lp in o.outputs[0].logprobs] for o in batched] == logprobs
    if kv_cache_dtype == "auto":
        assert tokens(alone) == expected


@pytest.mark.parametrize("variant", DEEPSEEK)
def test_kvslim_written_checkpoint_loads_in_transformers(hf_checkpoints, tmp_path, variant):
    model = load_model(hf_checkpoints[variant], dtype=torch.float32)
    out = save_model(model.hf_state_dict(), model.config, tmp_path / variant)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.logits(ids)
        assert (hf_model(out)(ids).logits - ours).abs().max().item() <= 1e-4
        assert torch.equal(load_model(out, dtype=torch.float32).logits(ids), ours)


def test_config_fields():
    v2 = ModelConfig.from_hf_dict(hf_config("deepseek_v2").to_dict())
    assert v2.mla.q_lora_rank is None and v2.mla.rope_interleave
    assert (v2.head_dim, v2.v_head_dim, v2.num_key_value_heads) == (24, 16, 4)
    assert (v2.moe.topk_method, v2.moe.n_group, v2.moe.topk_group) == ("group_limited_greedy", 4, 2)
    assert v2.moe.first_dense_layers == 1 and v2.moe.routed_scaling_factor == 1.5
    assert attention_scale(v2) == 24 ** -0.5
    v3 = ModelConfig.from_hf_dict(hf_config("deepseek_v3").to_dict())
    assert v3.mla.q_lora_rank == 24 and v3.moe.scoring == "sigmoid" and v3.moe.norm_topk_prob
    mscale = 0.1 * 0.8 * torch.log(torch.tensor(32.0)).item() + 1.0
    assert attention_scale(v3) == pytest.approx(24 ** -0.5 * mscale ** 2)


def test_v3_multi_token_prediction_layers_are_skipped(hf_checkpoints, tmp_path):
    """As transformers: a checkpoint's layers past num_hidden_layers are not loaded."""
    src = hf_checkpoints["deepseek_v3"]
    dst = tmp_path / "mtp"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    ids = torch.tensor([[5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(load_model(dst).logits(ids), load_model(src).logits(ids))


@pytest.mark.parametrize("variant,changes,message", [
    ("deepseek_v2", {"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ("deepseek_v2", {"v_head_dim": 32}, "v_head_dim 32 wider than a key head"),
    ("deepseek_v2", {"num_key_value_heads": 2}, "num_key_value_heads 2 != num_attention_heads"),
    ("deepseek_v2", {"n_group": 3}, "8 experts in n_group 3"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method 'greedy' with scoring_func"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 2}, "fewer than two of the 8 experts"),
])
def test_unsupported_fields_are_refused(variant, changes, message):
    cfg = {**json.loads(hf_config(variant).to_json_string()), **changes}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(cfg)
