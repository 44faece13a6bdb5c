"""A tensor-parallel shard's forward equals the full model's, on 2 and 4 gloo ranks: split KV
heads (GQA, MHA), replicated KV heads (MQA; GQA beyond its KV heads), per-layer KV heads, biases,
tied embeddings, q/k norms, Gemma 3, Phi-3's fused checkpoint and the MoE experts (Mixtral,
Qwen3-MoE).

Every case of one degree runs in one launch (starting the ranks costs more than the models), and
each case is then checked in its own test."""
import pytest
import torch

from checkpoints import VARIANTS, make_hf_model
from kvslim.formats.loader import init_model, load_model
from kvslim.models.config import ModelConfig
from tp_launch import launched_once_per_degree
from tp_workers import parity

TOLERANCE = 1e-5                       # float32 logits: only the summation order differs

# 8 query heads, 2 KV heads in layer 0 and 1 in layer 1; a vocabulary no degree divides (the
# last vocab shard is padded); biases on every projection (o_proj's and down_proj's added once)
NONUNIFORM = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads_per_layer": [2, 1], "attention_bias": True, "mlp_bias": True,
              "rms_norm_eps": 1e-5}

# Qwen3-MoE: experts of their own width, in checkpoints.py once that family is there
MOE = ["mixtral"] + [v for v in ("qwen3_moe",) if v in VARIANTS]
CASES = {
    2: ["mha", "gqa", "mqa", "qwen2_bias", "qwen3", "phi3", "tied", "gemma3", *MOE,
        "nonuniform"],
    4: ["mha", "mha8", "gqa", "mqa", "qwen2_bias", *MOE, "nonuniform"],
}
# (query heads, KV heads) each rank holds per layer
EXPECTED_HEADS = {
    (2, "gqa"): [(4, 1)] * 2, (2, "mqa"): [(4, 1)] * 2, (2, "mha"): [(2, 2)] * 2,
    (2, "nonuniform"): [(4, 1), (4, 1)],
    (4, "gqa"): [(2, 1)] * 2, (4, "mqa"): [(2, 1)] * 2, (4, "mha"): [(1, 1)] * 2,
    (4, "mha8"): [(2, 2)] * 2, (4, "nonuniform"): [(2, 1), (2, 1)],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """case -> the full model, saved whole for the ranks (tp_workers.build): each checkpoint
    variant written by transformers and read by `load_model`; the non-uniform one initialised
    from its config."""
    root = tmp_path_factory.mktemp("tp_models")
    out = {}
    for name in sorted({n for names in CASES.values() for n in names}):
        if name == "nonuniform":
            model = init_model(ModelConfig.from_hf_dict(NONUNIFORM), seed=0, std=0.1)
        else:
            make_hf_model(name).save_pretrained(root / name)
            model = load_model(root / name, dtype=torch.float32)
        torch.save(model, root / f"{name}.pt")
        out[name] = str(root / f"{name}.pt")
    return out


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> dict:
    """world_size -> [per rank: case -> figures]; launched once per degree, on first use."""
    return launched_once_per_degree(
        parity, lambda n: {name: models[name] for name in CASES[n]}, tmp_path_factory.mktemp)


@pytest.mark.parametrize("world_size,case",
                         [(n, case) for n, names in CASES.items() for case in names])
def test_sharded_logits_match_the_full_model(results, world_size, case):
    ranks = [r[case] for r in results(world_size)]
    for rank, figures in enumerate(ranks):
        assert figures["shape"], f"rank {rank}: logits shape differs"
        assert figures["dense"] < TOLERANCE, f"rank {rank}: dense forward off by {figures['dense']}"
        assert figures["prepared"] < TOLERANCE, \
            f"rank {rank}: prepared forward off by {figures['prepared']}"
    assert len({f["checksum"] for f in ranks}) == 1, "ranks disagree on the logits"
    if (world_size, case) in EXPECTED_HEADS:
        assert all(f["heads"] == EXPECTED_HEADS[world_size, case] for f in ranks)
