"""kvslim convert --to-mla: exact at full rank, the truncated cache's size, transformers' logits,
the paged engine's greedy tokens, the RoPE slots chosen, and every refusal before DST exists."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VOCAB
from engine.engine_helpers import GREEDY, engine, prompts_of, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.models.config import ModelConfig
from kvslim.surgery.mla.convert import RECORD, convert_to_mla
from kvslim.surgery.mla.frequencies import choose_kept
from kvslim.surgery.mla.options import MLAOptions

IDS = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(3))


def logits(path):
    with torch.no_grad():
        return load_model(path, dtype=torch.float32).logits(IDS)


def convert(src, dst, calib=None, **options):
    options.setdefault("calib", calib if options.get("method") == "transmla" else None)
    return convert_to_mla(src, dst, MLAOptions(calib_samples=4, calib_seq_len=32, **options),
                          show_progress=False)


def full(config, method):
    """Every RoPE dim kept and the latent at the K/V width left: nothing is dropped."""
    kv, d = config.num_key_value_heads, config.head_dim
    return dict(method=method, rope_dim=d if method == "mha2mla" else kv * d,
                kv_lora_rank=kv * d)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa", "llama3_rope"])
@pytest.mark.parametrize("method", ["mha2mla", "transmla"])
def test_full_rank_reproduces_the_source(hf_checkpoints, tmp_path, calib_file, variant, method):
    src = hf_checkpoints[variant]
    dst = convert(src, tmp_path / "mla", calib_file, latent_norm="exact",
                  **full(ModelConfig.from_dir(src), method))
    assert ModelConfig.from_dir(dst).architecture == "DeepseekV2ForCausalLM"
    ref = logits(src)
    assert (logits(dst) - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_calibrated_norm_is_the_only_change_at_full_rank(hf_checkpoints, tmp_path):
    """The two latent norms differ by the latent's scale alone; the calibrated one is not exact
    (a token's latent RMS is not the average), but close."""
    src = hf_checkpoints["gqa"]
    opts = full(ModelConfig.from_dir(src), "mha2mla")
    exact = load_model(convert(src, tmp_path / "e", latent_norm="exact", **opts))
    cal = load_model(convert(src, tmp_path / "c", latent_norm="calibrated", **opts))
    a, b = exact.model.layers[1].self_attn, cal.model.layers[1].self_attn
    assert torch.equal(a.kv_b_proj.weight, b.kv_b_proj.weight)
    ratio = a.kv_a_proj_with_mqa.weight[:16] / b.kv_a_proj_with_mqa.weight[:16]
    torch.testing.assert_close(ratio, ratio[0, 0].expand_as(ratio))
    assert ratio[0, 0] < 1e-6


@pytest.mark.parametrize("method,rope_dim,rank,width", [("mha2mla", 4, 6, 8),
                                                        ("transmla", 4, 6, 4)])
def test_truncation_prices_the_latent_row(hf_checkpoints, tmp_path, calib_file, method,
                                          rope_dim, rank, width):
    src = hf_checkpoints["gqa"]                     # 2 KV heads of 8: 32 K/V dims per layer
    dst = convert(src, tmp_path / "mla", calib_file, method=method, rope_dim=rope_dim,
                  kv_lora_rank=rank)
    config = ModelConfig.from_dir(dst)
    assert (config.mla.kv_lora_rank, config.mla.qk_rope_head_dim) == (rank, width)
    assert config.kv_bytes_per_token(torch.float32) == 2 * (rank + width) * 4
    record = json.loads((dst / RECORD).read_text())
    assert record["source_kv_bytes_per_token"] == 2 * 32 * 4
    assert record["kv_bytes_per_token"] == config.kv_bytes_per_token(torch.float32)
    assert sum(record["kept_per_frequency"]) * 2 == width


def test_a_lower_rank_loses_more(hf_checkpoints, tmp_path):
    src = hf_checkpoints["gqa"]
    ref = logits(src)
    errors = [(logits(convert(src, tmp_path / str(r), method="mha2mla", rope_dim=8,
                              kv_lora_rank=r, latent_norm="exact")) - ref).abs().max().item()
              for r in (2, 8, 16)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-4


def test_transformers_loads_the_result_with_identical_logits(hf_checkpoints, tmp_path,
                                                             calib_file):
    dst = convert(hf_checkpoints["gqa"], tmp_path / "mla", calib_file, method="transmla",
                  rope_dim=6, kv_lora_rank=10)
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV2ForCausalLM"
    with torch.no_grad():
        assert (hf(IDS).logits - logits(dst)).abs().max() <= 1e-4


def test_engine_greedy_tokens_batched_equal_alone(hf_checkpoints, tmp_path):
    dst = convert(hf_checkpoints["gqa"], tmp_path / "mla", method="mha2mla", rope_dim=4,
                  kv_lora_rank=12)
    prompts, params = prompts_of([3, 17, 9, 30]), SamplingParams(max_tokens=8, **GREEDY)
    eng = engine(dst)
    batched = tokens(run(eng, prompts, params))
    assert batched == [tokens(run(eng, [p], params))[0] for p in prompts]


def test_frequencies_kept_by_score():
    scores = torch.tensor([[1.0, 9.0, 3.0, 4.0],                # component 0 of each frequency
                           [0.5, 8.0, 0.1, 3.5]])               # component 1
    assert choose_kept(scores, "mha2mla", 4) == [0, 2, 0, 2]   # whole frequencies, by sum
    assert choose_kept(scores, "transmla", 6) == [0, 2, 0, 1]  # best components first
    assert choose_kept(scores, "transmla", 10) == [0, 2, 1, 2]


@pytest.mark.parametrize("variant,options,message", [
    ("gqa", dict(kv_lora_rank=29), "--kv-lora-rank 29 must be in 1..28 (the source's K/V width "
                                   "2 x 2 x 8 less 4 RoPE dims)"),
    ("gqa", dict(kv_lora_rank=8, rope_dim=10), "--rope-dim 10 must be even and in 2..8"),
    ("gqa", dict(kv_lora_rank=8, rope_dim=3), "--rope-dim 3 must be even"),
    ("gqa", dict(kv_lora_rank=8, method="transmla", rope_dim=18),
     "--rope-dim 18 must be even and in 2..16"),
    ("gqa", dict(kv_lora_rank=8, method="transmla"), "--method transmla needs calibration"),
    ("gqa", dict(kv_lora_rank=8, method="mean"), "unknown --method 'mean' for --to-mla"),
    ("qwen2_bias", dict(kv_lora_rank=8), "Qwen2ForCausalLM is not supported (its query bias"),
    ("qwen3", dict(kv_lora_rank=8), "Qwen3ForCausalLM is not supported"),
    ("deepseek_v2", dict(kv_lora_rank=8), "DeepseekV2ForCausalLM is not supported"),
    ("yarn_rope", dict(kv_lora_rank=8), "is not supported"),
])
def test_bad_input_is_refused_before_anything_is_written(hf_checkpoints, tmp_path, variant,
                                                         options, message):
    dst = tmp_path / "mla"
    with pytest.raises(KvslimError) as e:
        convert_to_mla(hf_checkpoints[variant], dst, MLAOptions(**options), show_progress=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not dst.exists()
