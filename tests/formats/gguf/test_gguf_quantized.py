"""GGUF files whose linear layers are Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K (mixed within a file and
within a fused layer) import with those layers kept quantized: the loaded blocks decode to exactly
what gguf.quants.dequantize gives (Q/K rows unpermuted), the model's logits equal the float
import's, and the kernels chosen by prepare_for_inference stay within their bfloat16 bound; greedy
decoding through the engine does not depend on the batch or on prefix-cache hits."""
import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_files import write_tiny_gguf
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import ConfigError, WeightsError
from kvslim.formats.gguf.importer import import_gguf
from kvslim.formats.info import model_info
from kvslim.formats.loader import load_model
from kvslim.quantization.gguf_embedding import BlockQuantEmbedding, TiedBlockQuantHead
from kvslim.quantization.gguf_blocks import BlockQuantLinear
from kvslim.quantization import QuantLinear

# The int4 kernel multiplies in bfloat16 (8 bits of mantissa): 1% of the largest output per
# layer (tests/quantization/test_quant_kernels.py); two layers and the LM head, 3% of the logits.
KERNEL_RTOL = 3e-2
SHARDS = {"q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
          "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
          "gate_proj": ("mlp.gate_up_proj", "gate"), "up_proj": ("mlp.gate_up_proj", "up"),
          "down_proj": ("mlp.down_proj", None)}


# A Q4_K_M-like mix: q/k/v of three types in one fused layer, gate/up of two, a Q8_0 tied table.
MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_1, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0}
FILES = {"Q4_0": {"qtype": Q.Q4_0}, "Q4_1": {"qtype": Q.Q4_1}, "Q5_0": {"qtype": Q.Q5_0},
         "mixed": {"types": MIXED, "hidden": 256, "ffn": 256, "tied": True}}


@pytest.fixture(scope="module", params=list(FILES))
def imported(request, tmp_path_factory):
    """(kept-quantized dir, float dir, expected HF weights) for one tiny file."""
    root = tmp_path_factory.mktemp(request.param)
    expected = write_tiny_gguf(root / "tiny.gguf", **FILES[request.param])
    kept = import_gguf(root / "tiny.gguf", root / "kept", show_progress=False, keep_quantized=True)
    dense = import_gguf(root / "tiny.gguf", root / "float", show_progress=False)
    return kept, dense, expected


def test_import_keeps_the_gguf_file(imported):
    kept, dense, expected = imported
    cfg = json.loads((kept / "config.json").read_text())
    tied = "lm_head.weight" not in expected
    assert cfg["quantization_config"] == {"quant_method": "gguf", "file": "tiny.gguf",
                                          "embedding": True, **({} if tied else {"lm_head": True})}
    assert (kept / "tiny.gguf").is_file() and not list(kept.glob("*.safetensors"))
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    assert model_info(kept).num_parameters == model_info(dense).num_parameters


def test_blocks_decode_to_the_gguf_dequantization(imported):
    kept, _, expected = imported
    model = load_model(kept, dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        for hf, (module_name, shard) in SHARDS.items():
            module = layer.get_submodule(module_name)
            assert isinstance(module, BlockQuantLinear)
            weight = module.dequantized_weight()
            start = 0
            for key, size in module.shard_sizes.items():
                if key == shard:
                    weight = weight[start:start + size]
                start += size
            part = "self_attn" if module_name.startswith("self_attn") else "mlp"
            ref = torch.from_numpy(expected[f"model.layers.{i}.{part}.{hf}.weight"])
            assert torch.equal(weight, ref), (i, hf)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, BlockQuantEmbedding)
    assert torch.equal(embedding.dequantized_weight(),
                       torch.from_numpy(expected["model.embed_tokens.weight"]))
    if "lm_head.weight" in expected:
        assert isinstance(model.lm_head, BlockQuantLinear)
        assert torch.equal(model.lm_head.dequantized_weight(),
                           torch.from_numpy(expected["lm_head.weight"]))
    else:
        assert isinstance(model.lm_head, TiedBlockQuantHead)


@torch.no_grad()
def test_logits_match_the_float_import(imported, float32_activations):
    kept, dense, _ = imported
    ids = torch.randint(0, 260, (2, 11), generator=torch.Generator().manual_seed(0))
    ref = load_model(dense, dtype=torch.float32).logits(ids)
    model = load_model(kept, dtype=torch.float32)
    torch.testing.assert_close(model.logits(ids), ref, rtol=0, atol=1e-5)
    model.prepare_for_inference()
    assert all(m.kernel is not None for m in model.modules() if isinstance(m, QuantLinear))
    err = float((model.logits(ids) - ref).abs().max())
    assert err <= KERNEL_RTOL * float(ref.abs().max()), err / float(ref.abs().max())


def test_greedy_does_not_depend_on_the_batch(imported):
    kept, _, _ = imported

    def engine(**config):
        return LLMEngine(str(kept), EngineConfig(dtype="float32", device="cpu",
                                                 kv_cache_memory="8MiB", **config))

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, 260, (n,), generator=g).tolist() for n in (5, 17, 1, 9)]
    together = _greedy(engine(), batch, params)
    alone = [_greedy(engine(), [p], params)[0] for p in batch]
    small = _greedy(engine(max_num_seqs=2, max_num_batched_tokens=8), batch, params)
    assert together == alone == small


def _greedy(eng, prompts, params):
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[i].outputs[0].token_ids for i in ids]


def test_other_linear_types_import_as_float_with_a_note(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "q5.gguf", qtype=Q.Q4_1, types={"ffn_down": Q.Q5_1})
    out = import_gguf(tmp_path / "q5.gguf", tmp_path / "q5", show_progress=False,
                      keep_quantized=True)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert list(out.glob("*.safetensors"))
    assert "'blk.0.ffn_down.weight' is Q5_1, which kvslim does not keep quantized; importing " \
        "every weight as float32" in capsys.readouterr().err
    write_tiny_gguf(tmp_path / "f32.gguf")                   # a float file: no note
    import_gguf(tmp_path / "f32.gguf", tmp_path / "f32", show_progress=False, keep_quantized=True)
    assert capsys.readouterr().err == ""


def test_quantized_only_names_the_tensor_and_type(tmp_path):
    write_tiny_gguf(tmp_path / "f16.gguf", qtype=Q.Q8_0, types={"attn_v": Q.F16})
    with pytest.raises(ConfigError, match=r"^f16.gguf: tensor 'blk.0.attn_v.weight' is F16, "
                                          r"which kvslim does not keep quantized"):
        import_gguf(tmp_path / "f16.gguf", tmp_path / "f16", show_progress=False,
                    require_quantized=True)
    assert not (tmp_path / "f16").exists()


def test_missing_gguf_file_is_a_clear_error(imported, tmp_path):
    kept, _, _ = imported
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.json").write_text((kept / "config.json").read_text())
    with pytest.raises(WeightsError, match="tiny.gguf"):
        load_model(moved)


BLOCK_BYTES_PER_WEIGHT = {"Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q5_0": 22 / 32}


@pytest.mark.parametrize("kind", list(BLOCK_BYTES_PER_WEIGHT))
def test_a_step_reads_the_blocks_not_a_float_copy(kind, tmp_path):
    """The roofline's bytes per decode step (formats/info.weight_bytes): the tensors kept in
    blocks at the file's block size, the float ones (the 1-D norms) at 4 bytes."""
    from kvslim.formats.info import weight_bytes
    from kvslim.models.config import ModelConfig
    expected = write_tiny_gguf(tmp_path / "t.gguf", **FILES[kind])
    kept = import_gguf(tmp_path / "t.gguf", tmp_path / "kept", show_progress=False,
                       keep_quantized=True)
    want = sum(w.size * (4 if w.ndim == 1 else BLOCK_BYTES_PER_WEIGHT[kind])
               for name, w in expected.items())
    assert weight_bytes(kept, ModelConfig.from_dir(kept), 4) == want
