"""Tensor parallelism of quantized models: each rank's shard is cut from the packed tensors (no
float copy of a weight) and holds exactly its slice of the full layer's dequantized weight,
and the sharded forward equals the full quantized model's on 2 and 4 gloo ranks — GPTQ 4-bit
(groups, act-order, biases), AWQ (converted to that layout at load), int8 per channel, W8A8 (each token's activation scale agreed
across the ranks) and GGUF blocks of mixed types with a quantized tied embedding table or an
untied quantized LM head.

What "equals" means, per path:
- dequantized weights in float32 (the unprepared forward; act-order layers, whose groups are
  out of order, keep this path prepared too): within 1e-5 of the logits' magnitude, only the
  summation order differs;
- W8A8's integer product: the same bound. Given the same input a row shard's int8 codes are
  the full layer's (`test_w8a8_row_shards_quantize_like_the_full_layer`); across layers an
  all-reduced sum can differ from the one-rank sum in its last bit and move an activation
  across a rounding boundary, which these seeded batches do not hit;
- the prepared int4/int8 kernels, which run in bfloat16 on the CPU: each rank rounds its
  partial sum, so the shard's logits cannot equal the full model's prepared ones; they are as
  accurate, within a factor 2 of the full model's distance from its float32 logits (with both
  kernels off by e, shard and full can differ by up to 2e)."""
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_files import write_tiny_gguf
from quantized_checkpoints import write_awq
from kvslim.errors import KvslimError
from kvslim.formats.gguf.importer import import_gguf
from kvslim.formats.loader import load_model
from kvslim.quantization.gguf_blocks import BlockQuantLinear
from kvslim.quantization import QuantLinear, QuantSpec
from kvslim.quantization.gptq import GPTQLinear
from kvslim.quantization.kernels import w8a8_linear
from kvslim.quantization.w8a8 import W8A8_SPEC, W8A8Linear
from kvslim.parallel import shard_model
from kvslim.parallel.quant_layers import quant_row_shard
from kvslim.surgery.quantize.model import quantize_model
from tp_launch import launched_once_per_degree, run_ranks
from tp_workers import parity

TOLERANCE = 1e-5
GPTQ4 = QuantSpec(4, 32, sym=False, checkpoint_format="gptq_v2")
GPTQ_CASES = {          # case -> (checkpoint variant, method, spec)
    "gptq4": ("gqa", "rtn", GPTQ4),
    "gptq4_bias": ("qwen2_bias", "rtn", GPTQ4),
    "int8": ("gqa", "rtn", QuantSpec(8, -1, sym=True)),
    "w8a8": ("gqa", "w8a8", W8A8_SPEC),
    "w8a8_mqa": ("mqa", "w8a8", W8A8_SPEC),
}
MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_1, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q6_K}
GGUF_CASES = {          # case -> write_tiny_gguf arguments
    "gguf_tied": dict(types={**MIXED, "token_embd": Q.Q8_0}, tied=True),
    "gguf_untied": dict(types={**MIXED, "token_embd": Q.Q4_0, "output": Q.Q6_K}),
}
CASES = {2: [*GPTQ_CASES, "gptq4_act_order", "awq", *GGUF_CASES],
         4: ["gptq4", "gptq4_act_order", "w8a8", "awq", *GGUF_CASES]}


def act_order(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every GPTQ layer's inputs assigned to random groups (a different order per shard), as
    act-order leaves them: a rank's rows then use groups from all over the layer."""
    gen = torch.Generator().manual_seed(seed)
    for layer in model.modules():
        if type(layer).__name__.startswith("Quant"):
            groups = layer.scales.shape[0]
            layer.g_idx.copy_(torch.randint(0, groups, layer.g_idx.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def models(hf_checkpoints, tmp_path_factory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("tp_quantized")
    out = {}
    for name, (variant, method, spec) in GPTQ_CASES.items():
        path = quantize_model(hf_checkpoints[variant], root / name, method, spec,
                              show_progress=False)
        out[name] = load_model(path, dtype=torch.float32)
    out["gptq4_act_order"] = act_order(load_model(root / "gptq4", dtype=torch.float32))
    # AutoAWQ's GEMM layout, packed by hand: converted to the GPTQ layout at load
    out["awq"] = load_model(write_awq(hf_checkpoints["gqa"], root / "awq")[0],
                            dtype=torch.float32)
    for name, kwargs in GGUF_CASES.items():
        write_tiny_gguf(root / f"{name}.gguf", hidden=256, ffn=256, **kwargs)
        path = import_gguf(root / f"{name}.gguf", root / name, show_progress=False,
                           keep_quantized=True)
        out[name] = load_model(path, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    """world_size -> [per rank: case -> figures], the models saved whole for the ranks."""
    root = tmp_path_factory.mktemp("tpq_saved")
    saved = {}
    for name, model in models.items():
        saved[name] = str(root / f"{name}.pt")
        torch.save(model, saved[name])
    return launched_once_per_degree(
        parity, lambda n: {name: saved[name] for name in CASES[n]}, tmp_path_factory.mktemp)


@pytest.mark.parametrize("world_size,case",
                         [(n, case) for n, names in CASES.items() for case in names])
def test_sharded_quantized_logits_match_the_full_model(results, world_size, case):
    ranks = [r[case] for r in results(world_size)]
    for rank, f in enumerate(ranks):
        assert f["shape"], f"rank {rank}: logits shape differs"
        bound = TOLERANCE * max(1.0, f["scale"])
        assert f["dense"] < bound, f"rank {rank}: forward off by {f['dense']} (scale {f['scale']})"
        if f["kernel"] < bound:          # exact kernels (W8A8, act-order's dequantized path)
            assert f["prepared"] < bound, f"rank {rank}: prepared forward off by {f['prepared']}"
        else:                            # bfloat16 kernels: as accurate as the full model's
            assert f["shard_kernel"] < 2 * f["kernel"], (
                f"rank {rank}: the shard's kernels are {f['shard_kernel']} from the float32 "
                f"logits, the full model's {f['kernel']}")
    assert len({f["checksum"] for f in ranks}) == 1, "ranks disagree on the logits"


def w8a8_row_parity(rank: int, world_size: int, full, x: torch.Tensor) -> dict:
    part = quant_row_shard(full, range(rank * 32, (rank + 1) * 32))
    agreed = part(x[:, rank * 32:(rank + 1) * 32])
    own = w8a8_linear(x[:, rank * 32:(rank + 1) * 32], part.weight, part.weight_scale.view(-1))
    torch.distributed.all_reduce(own)
    reference = full(x)
    return {"agreed": (agreed - reference).abs().max().item(),
            "own_scale": (own + full.bias - reference).abs().max().item()}


def test_w8a8_row_shards_quantize_like_the_full_layer(tmp_path):
    """Each rank quantizes its columns with the whole row's scale: the reduced sum is the full
    layer's integer product (float rounding of the partial sums apart). A rank that used its
    own slice's scale would not be."""
    gen = torch.Generator().manual_seed(0)
    full = W8A8Linear(64, 48, bias=True, spec=W8A8_SPEC)
    full.weight.copy_(torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8))
    full.weight_scale.copy_(torch.rand(48, 1, generator=gen) / 100)
    full.bias.data.copy_(torch.randn(48, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    x[:, :32] *= 10                 # the first half's scale is not the second half's
    ranks = run_ranks(w8a8_row_parity, 2, tmp_path, full, x)
    assert all(r["agreed"] < 1e-5 for r in ranks), ranks
    assert all(r["own_scale"] > 1e-3 for r in ranks), ranks


def _pairs(full, shard):
    """(name, full layer, shard layer) for every quantized linear layer."""
    shard_layers = dict(shard.named_modules())
    for name, layer in full.named_modules():
        if isinstance(layer, QuantLinear) and layer.LEAVES:
            yield name, layer, shard_layers[name]


@pytest.mark.parametrize("case", ["gptq4", "gptq4_act_order", "gptq4_bias", "int8", "w8a8",
                                  "awq", "gguf_untied"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_shard_holds_its_slice_packed(models, case, world_size):
    """Rank r's q/k/v and gate/up rows and o/down columns are the full layer's, dequantized
    from tensors of the full layer's packed dtypes and a 1/N share of its codes."""
    import copy
    full = models[case]
    config = full.config
    d, heads = config.head_dim, config.num_attention_heads
    rank = world_size - 1
    shard = shard_model(copy.deepcopy(full), rank, world_size)
    q_cols = range(rank * heads // world_size * d, (rank + 1) * heads // world_size * d)
    inter = config.intermediate_size // world_size
    mlp_cols = range(rank * inter, (rank + 1) * inter)
    for name, layer, part in _pairs(full, shard):
        for leaf in layer.LEAVES:
            a, b = getattr(layer, leaf), getattr(part, leaf)
            if a is not None and b is not None and leaf != "bias":
                assert b.dtype == a.dtype, f"{name}.{leaf}: {b.dtype} instead of {a.dtype}"
        w, got = layer.dequantized_weight(), part.dequantized_weight()
        if name.endswith("o_proj"):
            assert torch.equal(got, w[:, q_cols.start:q_cols.stop]), name
        elif name.endswith("down_proj"):
            assert torch.equal(got, w[:, mlp_cols.start:mlp_cols.stop]), name
        elif name.endswith("gate_up_proj"):
            gate, up = w.split(config.intermediate_size)
            assert torch.equal(got, torch.cat([gate[mlp_cols.start:mlp_cols.stop],
                                               up[mlp_cols.start:mlp_cols.stop]])), name
        elif name.endswith("qkv_proj"):
            assert got.shape[0] < w.shape[0] and got.shape[1] == w.shape[1], name
        if not name.endswith("qkv_proj"):      # replicated KV heads keep more than 1/N
            code = next(leaf for leaf in ("qweight", "weight", "qvalues") if hasattr(layer, leaf))
            assert getattr(part, code).numel() * world_size == getattr(layer, code).numel(), name


def test_a_gguf_block_split_off_its_32_input_boundary_is_refused():
    layer = BlockQuantLinear(64, 32, spec=QuantSpec(4, 32, method="gguf", file="x.gguf"))
    with pytest.raises(KvslimError, match="slices must be multiples of 32 inputs"):
        quant_row_shard(layer, range(16, 48))


def test_a_gptq_split_off_its_packing_is_refused():
    layer = GPTQLinear(64, 32, spec=GPTQ4)
    with pytest.raises(KvslimError, match="slices must be multiples of 8 inputs"):
        quant_row_shard(layer, range(4, 36))
