"""GGUF files of sparse MoE models: Mixtral as llama.cpp stores it (the `llama` architecture with
experts) and `qwen3moe`. The export's stacked expert tensors are checked against the checkpoint's
own per-expert matrices stacked the way llama.cpp's converter stacks them; import of the export
gives the original logits back; transformers' GGUF reader (which reads qwen3moe, not Mixtral) is
the independent reference where it can be."""
import json
import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from checkpoints import VOCAB, dense_greedy, hf_config, write_random_checkpoint
from gguf_files import write_tiny_gguf
from kvslim.errors import ConfigError
from kvslim.formats.gguf.exporter import export_gguf
from kvslim.formats.gguf.importer import hf_tensor_name, import_gguf
from kvslim.formats.loader import load_model
from kvslim.models.config import ModelConfig

IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 64, 250]])     # shorter than Mixtral's window (16)


def read_back(path) -> dict[str, tuple[Q, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type)
                     .reshape([int(d) for d in reversed(t.shape)]))
            for t in reader.tensors}


def metadata(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}




def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def mixtral_gguf(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral_gguf")
    return {dtype: export_gguf(hf_checkpoints["mixtral"], root / f"mixtral-{dtype}.gguf", dtype,
                               show_progress=False) for dtype in ("f32", "q8_0")}


def test_mixtral_experts_are_stacked_as_llama_cpp_does(hf_checkpoints, mixtral_gguf):
    """llama.cpp's converter: torch.stack of the experts' w1 (gate), w3 (up), w2 (down) along a
    new first dimension, the router as ffn_gate_inp; an llama file with expert counts."""
    stored = load_file(hf_checkpoints["mixtral"] / "model.safetensors")
    tensors = read_back(mixtral_gguf["f32"])
    for layer in range(2):
        moe = f"model.layers.{layer}.block_sparse_moe"
        for gguf_part, w in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"),
                             ("ffn_down_exps", "w2")):
            want = torch.stack([stored[f"{moe}.experts.{e}.{w}.weight"] for e in range(4)])
            qtype, got = tensors[f"blk.{layer}.{gguf_part}.weight"]
            assert qtype == Q.F32 and got.shape == tuple(want.shape)
            np.testing.assert_array_equal(got, want.numpy())
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_gate_inp.weight"][1],
                                      stored[f"{moe}.gate.weight"].numpy())
    meta = metadata(mixtral_gguf["f32"])
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.expert_count"], meta["llama.expert_used_count"]) == (4, 2)
    assert meta["llama.feed_forward_length"] == 128                 # Mixtral's expert width


def test_mixtral_round_trip_gives_the_original_logits(hf_checkpoints, mixtral_gguf, tmp_path):
    from transformers import AutoModelForCausalLM
    out = import_gguf(mixtral_gguf["f32"], tmp_path / "back", show_progress=False)
    again = load_model(out, dtype=torch.float32)
    cfg = again.config
    assert cfg.architecture == "MixtralForCausalLM" and cfg.moe.norm_topk_prob
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok) == (4, 2)
    original = load_model(hf_checkpoints["mixtral"], dtype=torch.float32)
    with torch.no_grad():
        assert (again.logits(IDS) - original.logits(IDS)).abs().max().item() <= 1e-5
    # transformers cannot read a Mixtral GGUF (it builds a dense Llama); it reads the import
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.model_type == "mixtral"
    for n in (5, 12):
        prompt = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        assert dense_greedy(again, prompt, 24) == hf_greedy(hf, prompt, 24)


def unstacked(src, dst):
    """An F32 Mixtral file as llama.cpp's converter wrote it before it stacked the experts: each
    expert's gate, up and down projection its own 2-D tensor `blk.N.ffn_gate.E.weight`."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for name, (_, values) in read_back(src).items():
        if m := re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", name):
            for e, w in enumerate(values):
                writer.add_tensor(f"blk.{m[1]}.ffn_{m[2]}.{e}.weight", np.ascontiguousarray(w))
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unstacked_experts_of_older_mixtral_files_import_too(mixtral_gguf, tmp_path):
    name = hf_tensor_name("blk.1.ffn_down.3.weight")
    assert name == "model.layers.1.mlp.experts.3.down_proj.weight"
    with pytest.raises(ConfigError, match="unexpected GGUF tensor 'blk.1.ffn_down.3.weight'"):
        hf_tensor_name("blk.1.ffn_down.3.weight", "qwen2")
    old = unstacked(mixtral_gguf["f32"], tmp_path / "old.gguf")
    assert "blk.0.ffn_up.3.weight" in {t.name for t in gguf.GGUFReader(old).tensors}
    stacked = load_model(import_gguf(mixtral_gguf["f32"], tmp_path / "a", show_progress=False))
    again = load_model(import_gguf(old, tmp_path / "b", show_progress=False))
    with torch.no_grad():
        assert torch.equal(again.logits(IDS), stacked.logits(IDS))


def test_quantized_mixtral_keeps_its_router_f32_and_imports_as_float(mixtral_gguf, tmp_path):
    tensors = read_back(mixtral_gguf["q8_0"])
    assert tensors["blk.0.ffn_gate_inp.weight"][0] == Q.F32        # llama.cpp's rule
    assert tensors["blk.0.ffn_gate_exps.weight"][0] == Q.Q8_0
    out = import_gguf(mixtral_gguf["q8_0"], tmp_path / "kept", show_progress=False,
                      keep_quantized=True)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    state = load_model(out, dtype=torch.float32).hf_state_dict()
    for e in range(4):
        np.testing.assert_array_equal(
            state[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].detach().numpy(),
            tensors["blk.0.ffn_up_exps.weight"][1][e])
    with pytest.raises(ConfigError, match="imports MoE GGUF files as float32 only"):
        import_gguf(mixtral_gguf["q8_0"], tmp_path / "no", show_progress=False,
                    require_quantized=True)
    assert not (tmp_path / "no").exists()


def qwen3_moe_checkpoint(root):
    """transformers' GGUF reader takes Qwen3-MoE's expert width from no key (it keeps its
    default, 768) and renormalises the top-k weights, as llama.cpp does: a tiny checkpoint so."""
    cfg = hf_config("qwen3_moe")
    cfg.moe_intermediate_size, cfg.norm_topk_prob = 768, True
    return write_random_checkpoint(cfg, root)


def test_qwen3moe_round_trip_and_transformers_reads_it(tmp_path):
    from transformers import AutoModelForCausalLM
    src = qwen3_moe_checkpoint(tmp_path / "q3moe")
    path = export_gguf(src, tmp_path / "q3moe.gguf", "f32", show_progress=False)
    meta = metadata(path)
    assert meta["general.architecture"] == "qwen3moe"
    assert (meta["qwen3moe.expert_count"], meta["qwen3moe.expert_used_count"]) == (6, 2)
    assert meta["qwen3moe.expert_feed_forward_length"] == 768
    assert meta["qwen3moe.feed_forward_length"] == 128             # the dense width
    ours = load_model(src, dtype=torch.float32)
    again = load_model(import_gguf(path, tmp_path / "back", show_progress=False))
    assert again.config.architecture == "Qwen3MoeForCausalLM" and again.config.qk_norm
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ref(IDS).logits - ours.logits(IDS)).abs().max().item() <= 1e-5
        assert (again.logits(IDS) - ours.logits(IDS)).abs().max().item() <= 1e-5
    prompt = IDS[0, :5].tolist()
    assert dense_greedy(again, prompt, 24) == hf_greedy(ref, prompt, 24)


def test_qwen3_moe_without_renormalised_weights_is_not_exported(hf_checkpoints, tmp_path):
    """llama.cpp's qwen3moe always renormalises: such a file would run another model."""
    assert not ModelConfig.from_dir(hf_checkpoints["qwen3_moe"]).moe.norm_topk_prob
    with pytest.raises(ConfigError, match="norm_topk_prob false"):
        export_gguf(hf_checkpoints["qwen3_moe"], tmp_path / "q.gguf", "f32", show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_qwen3moe_file_without_experts_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen3moe")
    with pytest.raises(ConfigError, match="has no 'qwen3moe.expert_count'"):
        import_gguf(tmp_path / "q.gguf", tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()
