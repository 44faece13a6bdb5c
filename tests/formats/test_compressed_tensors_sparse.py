"""compressed-tensors' sparse layouts (sparse-bitmask, sparse-24-bitmask): a checkpoint packed
here by the published rules (numpy's packbits, not kvslim's writer) loads to its weights; kvslim's
writer gives the library's own tensors, byte for byte, and the library reads them back; a
pruned model written this way (float, W8A8, 4-bit pack-quantized) computes what its dense
copy does; bad configs and tensors are refused in one line."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvslim.cli.main import main
from kvslim.errors import ConfigError, WeightsError
from kvslim.formats.compressed_tensors_sparse import (compress_24, compress_bitmask, decompress,
                                                      pack_bits, unpack_bits)
from kvslim.formats.loader import load_model
from kvslim.quantization import QuantSpec
from kvslim.surgery.prune.masks import SparsityTarget
from kvslim.surgery.prune.model import prune_model

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.arange(3, 27).view(1, 24)
FORMATS = ("sparse-bitmask", "sparse-24-bitmask")


def is_linear(name):
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in PROJ


def hand_pack(w, fmt):
    """One weight's tensors by the published rules: numpy.packbits(bitorder="little") of the
    nonzeros' places, the nonzeros row-major, row_offsets by cumsum."""
    mask = (w != 0).numpy()
    bits = torch.from_numpy(np.packbits(mask, axis=-1, bitorder="little"))
    if fmt == "sparse-bitmask":
        counts = mask.sum(axis=1)
        return {"shape": torch.tensor(list(w.shape)), "compressed": w[w != 0],
                "bitmask": bits, "row_offsets": torch.from_numpy(np.cumsum(counts) - counts)}
    return {"shape": torch.tensor(list(w.shape)).reshape(2, 1),
            "compressed": w[w != 0].reshape(w.shape[0], -1), "bitmask": bits}


def sparse_qcfg(fmt, structure, **quant):
    """quantization_config as compressed-tensors 0.12.2's `update_config` writes it."""
    return {"quant_method": "compressed-tensors", "version": "0.12.2", "transform_config": {},
            "sparsity_config": {"format": fmt, "global_sparsity": 0.5, "ignore": ["lm_head"],
                                "registry_requires_subclass": False,
                                "sparsity_structure": structure, "targets": ["Linear"]},
            **quant}


def hand_built(src, dst, fmt, sharded=False):
    """The source's decoder linears pruned here (2:4 by magnitude, or about half of each row at
    random) and stored compressed; with `sharded`, each weight's bitmask and shape in a second
    file. Returns the pruned dense weights by name."""
    gen = torch.Generator().manual_seed(0)
    first, second, pruned = {}, {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not is_linear(name):
            first[name] = t
            continue
        if fmt == "sparse-24-bitmask":
            low = t.view(-1, 4).abs().topk(2, dim=1, largest=False).indices
            w = t.view(-1, 4).scatter(1, low, 0.0).view(t.shape)
        else:
            w = torch.where(torch.rand(t.shape, generator=gen) < 0.5, 0.0, t)
        pruned[name] = w
        for leaf, v in hand_pack(w, fmt).items():
            (second if sharded and leaf in ("bitmask", "shape") else first)[
                f"{name.removesuffix('.weight')}.{leaf}"] = v
    dst.mkdir()
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    if not sharded:
        files = {"model.safetensors": first}
    for fname, tensors in files.items():
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
    if sharded:
        index = {"weight_map": {k: f for f, ts in files.items() for k in ts}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = sparse_qcfg(fmt, "2:4" if "24" in fmt else "unstructured")
    (dst / "config.json").write_text(json.dumps(cfg))
    return pruned


def test_bitmasks_are_numpys_little_endian_packbits():
    gen = torch.Generator().manual_seed(0)
    for cols in (1, 7, 8, 13, 64):
        mask = torch.rand(5, cols, generator=gen) < 0.4
        want = np.packbits(mask.numpy(), axis=-1, bitorder="little")
        assert np.array_equal(pack_bits(mask).numpy(), want)
        assert torch.equal(unpack_bits(pack_bits(mask), cols), mask)


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_hand_built_checkpoint_loads_to_its_weights(hf_checkpoints, tmp_path, fmt, sharded):
    src = hf_checkpoints["gqa"]
    pruned = hand_built(src, tmp_path / "ct", fmt, sharded)
    model = load_model(tmp_path / "ct", dtype=torch.float32)
    assert model.config.quantization is None
    views = model.hf_state_dict()
    for name, w in pruned.items():
        assert torch.equal(views[name], w), name
    dense = {**load_file(str(src / "model.safetensors")), **pruned}
    (tmp_path / "dense").mkdir()
    save_file(dense, str(tmp_path / "dense" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "dense" / "config.json").write_text((src / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(model.logits(IDS), load_model(tmp_path / "dense",
                                                         dtype=torch.float32).logits(IDS))


def random_sparse(gen, rows, cols, dtype, two_four):
    """Weights with every pattern of at most 2 nonzeros per group of 4 (2:4: including groups
    where a kept weight is zero, which then stores zeros), or about 60% zeros."""
    if two_four:
        patterns = torch.tensor([[(p >> i) & 1 for i in range(4)] for p in range(16)
                                 if bin(p).count("1") <= 2], dtype=torch.float32)
        mask = patterns[torch.randint(len(patterns), (rows * cols // 4,), generator=gen)]
        w = (mask * torch.randn(mask.shape, generator=gen)).reshape(rows, cols)
    else:
        w = torch.randn(rows, cols, generator=gen)
        w[torch.rand(rows, cols, generator=gen) < 0.6] = 0
    return (w * 40).round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_writer_gives_the_librarys_tensors(dtype):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.sparse_compressors.sparse_24_bitmask import (
        Sparse24BitMaskTensor, sparse24_bitmask_decompress)
    from compressed_tensors.compressors.sparse_compressors.sparse_bitmask import (
        BitmaskTensor, bitmask_decompress)
    gen = torch.Generator().manual_seed(1)
    for rows, cols in ((5, 12), (64, 128), (3, 20)):
        w = random_sparse(gen, rows, cols, dtype, two_four=False)
        ours = compress_bitmask(w)
        theirs = BitmaskTensor.from_dense(w).dict("m", device="cpu")
        assert list(theirs) == [f"m.{leaf}" for leaf in ours]
        for leaf, t in ours.items():
            assert t.dtype == theirs[f"m.{leaf}"].dtype and torch.equal(t, theirs[f"m.{leaf}"])
        assert torch.equal(bitmask_decompress(ours["compressed"], ours["bitmask"], w.shape), w)
        assert torch.equal(decompress("sparse-bitmask", "m", ours), w)

        w = random_sparse(gen, rows, cols, dtype, two_four=True)
        ours = compress_24(w)
        theirs = Sparse24BitMaskTensor.from_dense(w).dict("m.weight", device="cpu")
        assert list(theirs) == [f"m.{leaf}" for leaf in ours]
        for leaf, t in ours.items():
            other = theirs[f"m.{leaf}"]
            assert t.dtype == other.dtype and t.shape == other.shape and torch.equal(t, other)
        assert torch.equal(sparse24_bitmask_decompress(ours["compressed"], ours["bitmask"],
                                                       list(w.shape)), w)
        assert torch.equal(decompress("sparse-24-bitmask", "m", ours), w)


def test_two_four_keeps_every_nonzero_or_refuses():
    """|-128| is taken in int16: compressed-tensors 0.12.2 takes it in int8 (-128, the smallest)
    and would keep a zero in its place."""
    w = torch.tensor([[-128, 5, 0, 0, 0, 0, 0, 0]], dtype=torch.int8)
    assert torch.equal(decompress("sparse-24-bitmask", "m", compress_24(w)), w)
    with pytest.raises(ValueError, match="more than 2 nonzeros"):
        compress_24(torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


@pytest.fixture(scope="module")
def pruned_pair(hf_checkpoints, tmp_path_factory):
    """(target, spec) -> (dense-written dir, compressed-tensors-written dir), cached."""
    root, made = tmp_path_factory.mktemp("pruned"), {}

    def get(target, spec=None):
        key = (str(target), spec)
        if key not in made:
            tag = f"{len(made)}"
            made[key] = tuple(prune_model(hf_checkpoints["gqa"], root / f"{tag}{fmt}",
                                          "magnitude", target, spec, show_progress=False,
                                          output_format=fmt)
                              for fmt in ("dense", "compressed-tensors"))
        return made[key]
    return get


def qcfg(path):
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("target,fmt", [(SparsityTarget(n=2, m=4), "sparse-24-bitmask"),
                                        (SparsityTarget(sparsity=0.5), "sparse-bitmask")])
def test_pruned_model_written_compressed_computes_the_same(pruned_pair, target, fmt):
    dense, ct = pruned_pair(target)
    cfg = json.loads((ct / "config.json").read_text())
    assert cfg["kvslim_pruning"]["method"] == "magnitude"
    sparsity = cfg["quantization_config"]["sparsity_config"]
    assert sparsity["format"] == fmt and "config_groups" not in cfg["quantization_config"]
    assert sparsity["sparsity_structure"] == ("2:4" if target.structured else "unstructured")
    stored = load_file(str(ct / "model.safetensors"))
    assert not [k for k in stored if is_linear(k)]
    with torch.no_grad():
        assert torch.equal(load_model(dense, dtype=torch.float32).logits(IDS),
                           load_model(ct, dtype=torch.float32).logits(IDS))
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_compression_config(cfg["quantization_config"])
    theirs = dict(compressor.sparsity_compressor.decompress(str(ct)))
    want = load_file(str(dense / "model.safetensors"))
    assert sorted(theirs) == sorted(want)
    for name, t in want.items():
        assert torch.equal(theirs[name], t), name


def test_pruned_model_written_compressed_runs_in_the_engine(pruned_pair):
    from engine.engine_helpers import GREEDY, engine, run, tokens
    from kvslim.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=8, **GREEDY)
    outs = [tokens(run(engine(path), [[5, 6, 7, 8], [9, 10]], params))
            for path in pruned_pair(SparsityTarget(n=2, m=4))]
    assert outs[0] == outs[1] and len(outs[1][0]) == 8


def test_w8a8_kept_weights_are_stored_int8_and_bitmask_compressed(pruned_pair):
    from kvslim.quantization.w8a8 import W8A8Linear
    from engine.engine_helpers import GREEDY, engine, run, tokens
    from kvslim.engine.sampling_params import SamplingParams
    dense, ct = pruned_pair(SparsityTarget(n=2, m=4), QuantSpec(8, -1, False, True, "gptq"))
    cfg = qcfg(ct)
    assert cfg["format"] == "int-quantized"
    assert cfg["sparsity_config"]["format"] == "sparse-24-bitmask"
    stored = load_file(str(ct / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    assert stored[f"{name}.compressed"].dtype == torch.int8 and f"{name}.weight_scale" in stored
    ours, gptq = load_model(ct, dtype=torch.float32), load_model(dense, dtype=torch.float32)
    for layer, ref in zip(ours.model.layers, gptq.model.layers):
        for sub in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            w8a8 = layer.get_submodule(sub)
            assert isinstance(w8a8, W8A8Linear)
            assert (w8a8.weight.view(-1, 4) != 0).sum(-1).max() <= 2
            assert torch.equal(w8a8.dequantized_weight(),
                               ref.get_submodule(sub).dequantized_weight().float())
    out = tokens(run(engine(ct), [[5, 6, 7, 8]], SamplingParams(max_tokens=8, **GREEDY)))
    assert len(out[0]) == 8
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    theirs = dict(ModelCompressor.from_compression_config(cfg).sparsity_compressor
                  .decompress(str(ct)))
    views = ours.hf_state_dict()
    for key, t in theirs.items():
        if is_linear(key) or key.endswith(".weight_scale"):
            assert torch.equal(views[key], t), key


@pytest.mark.parametrize("sym", [True, False])
def test_four_bit_is_pack_quantized_with_dense_sparsity_metadata(pruned_pair, sym):
    spec = QuantSpec(4, 32, False, sym, "gptq" if sym else "gptq_v2")
    dense, ct = pruned_pair(SparsityTarget(sparsity=0.5), spec)
    cfg = qcfg(ct)
    assert cfg["format"] == "pack-quantized" and cfg["sparsity_config"]["format"] == "dense"
    assert cfg["config_groups"]["group_0"]["weights"]["symmetric"] is sym
    ours, gptq = load_model(ct, dtype=torch.float32), load_model(dense, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours.logits(IDS), gptq.logits(IDS))
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
        unpack_from_int32)
    stored = load_file(str(ct / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"
    shape = stored[f"{name}.weight_shape"].tolist()
    q = unpack_from_int32(stored[f"{name}.weight_packed"], 4, torch.Size(shape))
    scale = stored[f"{name}.weight_scale"].float()
    zp = (unpack_from_int32(stored[f"{name}.weight_zero_point"], 4,
                            torch.Size(scale.shape), packed_dim=0) if not sym else 0)
    groups = torch.arange(shape[1]) // 32
    w = (q - (zp[:, groups] if not sym else 0)) * scale[:, groups]
    ref = gptq.model.layers[0].self_attn.qkv_proj.dequantized_weight().float()
    q_rows = ref.shape[0] - 2 * shape[0]
    assert torch.equal(w, ref[q_rows:q_rows + shape[0]])
    assert (w == 0).float().mean() >= 0.5


def test_transformers_reads_it_if_it_can(pruned_pair):
    """transformers 5.23 cannot: it asks for compressed-tensors >= 0.15 for any
    compressed-tensors checkpoint (0.20 dropped the sparse compressors), and its
    CompressedTensorsConfig no longer keeps a sparsity_config (with the version check
    bypassed, compressed-tensors 0.12.2's ModelCompressor fails on the missing attribute).
    Should a version load it, its logits must be kvslim's."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    dense, ct = pruned_pair(SparsityTarget(n=2, m=4))
    try:
        hf = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"transformers does not load sparse compressed-tensors checkpoints: {e}")
    with torch.no_grad():
        theirs = hf(IDS).logits
        ours = load_model(ct, dtype=torch.float32).logits(IDS)
    assert (ours - theirs).abs().max() < 1e-4


def test_unknown_sparsity_format_is_refused(hf_checkpoints, tmp_path):
    hand_built(hf_checkpoints["gqa"], tmp_path / "ct", "sparse-bitmask")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    cfg["quantization_config"]["sparsity_config"]["format"] = "marlin-24"
    (tmp_path / "ct" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_model(tmp_path / "ct", dtype=torch.float32)
    assert "\n" not in str(err.value)
    assert "sparsity_config.format 'marlin-24' is not supported" in str(err.value)


MALFORMED = [
    ("sparse-bitmask", "compressed", lambda t: t[:-1], r"\.compressed has shape \[\d+\], but "
     r".*\.bitmask marks \d+ values"),
    ("sparse-bitmask", "bitmask", lambda t: t[:-1], r"\.bitmask is torch\.uint8 \[63, 8\], "
     r"expected uint8 \[64, 8\]"),
    ("sparse-bitmask", "row_offsets", lambda t: t + 1, r"\.row_offsets disagrees"),
    ("sparse-bitmask", "shape", lambda t: torch.tensor([64, 64, 1]), r"\.shape must hold 2"),
    ("sparse-24-bitmask", "compressed", lambda t: t[:, :-1], r"\.compressed has shape "
     r"\[64, 31\], but .*\.bitmask marks 2048 values \(\[64, 32\] expected\)"),
    ("sparse-24-bitmask", "shape", lambda t: torch.tensor([[64], [72]]),
     r"\.bitmask is torch\.uint8 \[64, 8\], expected uint8 \[64, 9\]"),
]


@pytest.mark.parametrize("fmt,leaf,edit,message", MALFORMED,
                         ids=[f"{f}-{leaf}" for f, leaf, _, _ in MALFORMED])
def test_malformed_tensors_are_refused_by_name(hf_checkpoints, tmp_path, fmt, leaf, edit,
                                               message):
    hand_built(hf_checkpoints["gqa"], tmp_path / "ct", fmt)
    path = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(str(path))
    name = f"model.layers.1.self_attn.q_proj.{leaf}"
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(WeightsError) as err:
        load_model(tmp_path / "ct", dtype=torch.float32)
    assert "\n" not in str(err.value) and "model.layers.1.self_attn.q_proj." in str(err.value)
    assert re.search(message, str(err.value)), str(err.value)


def test_a_missing_tensor_is_named(hf_checkpoints, tmp_path):
    hand_built(hf_checkpoints["gqa"], tmp_path / "ct", "sparse-bitmask")
    path = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.0.mlp.up_proj.row_offsets"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="missing weight 'model.layers.0.mlp.up_proj."
                                           "row_offsets' \\(sparse-bitmask stores"):
        load_model(tmp_path / "ct", dtype=torch.float32)


def test_eight_bits_need_w8a8s_grid(hf_checkpoints, tmp_path, capsys):
    dst = tmp_path / "x"
    assert main(["prune", str(hf_checkpoints["gqa"]), str(dst), "--method", "magnitude",
                 "--pattern", "2:4", "--bits", "8", "--format", "compressed-tensors",
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs --group-size -1 and --sym" in err, err
    assert not dst.exists()
