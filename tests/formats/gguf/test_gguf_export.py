"""GGUF export: read back with gguf's own reader (weights, Q/K order, metadata, vocabulary),
re-import with kvslim's importer for identical logits and tokens, load with transformers' GGUF
loader as an independent reader, and the errors."""
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_files import llama_cpp_permute
from kvslim.cli.main import main
from kvslim.errors import ConfigError
from kvslim.models.config import ModelConfig
from kvslim.formats.gguf.exporter import export_gguf, permute_qk, storage_type
from kvslim.formats.gguf.importer import hf_tensor_name, import_gguf, unpermute_qk
from kvslim.formats.loader import load_model
from kvslim.layers.rope import rope_inv_freq
from kvslim.tokenizer.tokenizer import Tokenizer

TEXTS = ["Hello world", "It is a truth universally acknowledged, that a single man",
         "<|im_start|>user\nhi<|im_end|>\n", "é ü 日本 ✓ — 4096 bytes!"]
IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 64, 250]])


@pytest.fixture(scope="module")
def exported(hf_checkpoints, tmp_path_factory):
    """(variant, dtype) -> exported file, written once per module."""
    root, files = tmp_path_factory.mktemp("gguf_export"), {}

    def get(variant: str, dtype: str):
        if (variant, dtype) not in files:
            files[variant, dtype] = export_gguf(hf_checkpoints[variant],
                                                root / f"{variant}-{dtype}.gguf", dtype,
                                                show_progress=False)
        return files[variant, dtype]
    return get


def read_back(path) -> dict[str, tuple[Q, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type)
                     .reshape([int(d) for d in reversed(t.shape)]))
            for t in reader.tensors}


def gguf_layout(name: str, hf: torch.Tensor, cfg: ModelConfig) -> np.ndarray:
    """The HF weight as llama.cpp's converter would store it (the tests' own permute)."""
    value = hf.float().numpy()
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    part = name.split(".")[2] if name.startswith("blk.") else ""
    return llama_cpp_permute(value, heads[part]) if part in heads else value


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_read_back_reproduces_weights(hf_checkpoints, exported, dtype):
    cfg = ModelConfig.from_dir(hf_checkpoints["gqa"])
    state = load_model(hf_checkpoints["gqa"], dtype=torch.float32).hf_state_dict()
    tensors = read_back(exported("gqa", dtype))
    hf_names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                "output_norm.weight": "model.norm.weight"}
    assert len(tensors) == len(state)
    for name, (qtype, got) in tensors.items():
        hf_name = hf_names.get(name) or hf_tensor_name(name)
        want = gguf_layout(name, state[hf_name], cfg)
        assert got.shape == want.shape, name
        if want.ndim == 1 or dtype == "f32":
            assert qtype == Q.F32
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif dtype in ("f16", "bf16"):
            cast = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
            assert qtype == {"f16": Q.F16, "bf16": Q.BF16}[dtype]
            np.testing.assert_array_equal(got, torch.from_numpy(want).to(cast).float().numpy(),
                                          err_msg=name)
        else:
            # Q8_0: int8 times one fp16 scale d = max|block| / 127 per 32 values. Rounding to
            # the int8 grid costs at most d / 2; storing d as fp16 (11-bit mantissa) moves
            # the largest multiple, 127 d, by at most 127 * 2^-11 d more.
            assert qtype == Q.Q8_0
            step = np.abs(want).reshape(-1, 32).max(axis=1) / 127
            err = np.abs(got - want).reshape(-1, 32).max(axis=1)
            assert (err <= (0.5 + 127 / 2048) * step + 1e-7).all(), name


def test_metadata_and_vocabulary(hf_checkpoints, exported):
    reader = gguf.GGUFReader(exported("gqa", "q8_0"))

    def get(key):
        return reader.fields[key].contents()
    assert get("general.architecture") == "llama"
    assert get("general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert (get("llama.block_count"), get("llama.embedding_length")) == (2, 64)
    assert (get("llama.attention.head_count"), get("llama.attention.head_count_kv")) == (8, 2)
    assert (get("llama.context_length"), get("llama.rope.freq_base")) == (512, 10000.0)
    assert get("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert get("tokenizer.ggml.model") == "gpt2" and get("tokenizer.ggml.pre") == "gpt-2"
    tokens, types = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 320                   # one per embedding row
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[:3] == [3] * 3
    assert tokens[300] == "[PAD300]" and set(types[300:]) == {5}
    assert get("tokenizer.ggml.eos_token_id") == 0 and not get("tokenizer.ggml.add_bos_token")
    assert get("tokenizer.chat_template") == Tokenizer.from_dir(hf_checkpoints["gqa"]).chat_template
    spec = json.loads((hf_checkpoints["gqa"] / "tokenizer.json").read_text())
    assert len(get("tokenizer.ggml.merges")) == len(spec["model"]["merges"])


@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_reimport_gives_identical_logits_and_tokens(hf_checkpoints, exported, tmp_path, variant):
    path = exported(variant, "f32")
    assert ("output.weight" in {t.name for t in gguf.GGUFReader(path).tensors}) == \
        (variant != "tied")                                   # tied: llama.cpp reuses token_embd
    out = import_gguf(path, tmp_path / "reimported", show_progress=False)
    original = load_model(hf_checkpoints[variant], dtype=torch.float32)
    again = load_model(out, dtype=torch.float32)
    assert again.config.num_key_value_heads == original.config.num_key_value_heads == 2
    with torch.no_grad():
        assert torch.equal(again.logits(IDS), original.logits(IDS))
    tok, tok_again = Tokenizer.from_dir(hf_checkpoints[variant]), Tokenizer.from_dir(out)
    for text in TEXTS:
        assert tok_again.encode(text) == tok.encode(text), text
        assert tok_again.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_transformers_gguf_loader_reads_the_export(hf_checkpoints, exported):
    """transformers un-permutes Q/K with its own code: agreeing with it shows the export uses
    llama.cpp's layout, not merely one that kvslim's importer happens to invert."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = exported("gqa", "f32")
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    ours = load_model(hf_checkpoints["gqa"], dtype=torch.float32)
    with torch.no_grad():
        assert (ref(IDS).logits - ours.logits(IDS)).abs().max().item() <= 1e-5
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = Tokenizer.from_dir(hf_checkpoints["gqa"])
    assert [hf_tok(t)["input_ids"] for t in TEXTS] == [tok.encode(t) for t in TEXTS]


def test_qwen2_biases_and_llama3_rope_factors(hf_checkpoints, exported):
    cfg = ModelConfig.from_dir(hf_checkpoints["qwen2_bias"])
    state = load_model(hf_checkpoints["qwen2_bias"], dtype=torch.float32).hf_state_dict()
    tensors = read_back(exported("qwen2_bias", "f16"))
    q_bias = state["model.layers.1.self_attn.q_proj.bias"]
    assert tensors["blk.1.attn_q.bias"][0] == Q.F32
    # a qwen2 file: rows as HF has them (llama.cpp's converter permutes only llama files)
    np.testing.assert_array_equal(tensors["blk.1.attn_q.bias"][1], q_bias.numpy())
    assert not np.array_equal(q_bias.numpy(), gguf_layout("blk.1.attn_q.bias", q_bias, cfg))
    cfg = ModelConfig.from_dir(hf_checkpoints["llama3_rope"])
    qtype, factors = read_back(exported("llama3_rope", "f32"))["rope_freqs.weight"]
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    np.testing.assert_allclose(plain.numpy() / factors, scaled.numpy(), rtol=1e-6)
    assert factors.min() >= 1.0 and factors.max() == cfg.rope_scaling["factor"]


def test_permute_is_the_inverse_of_the_importers():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=48,
                      intermediate_size=8, num_hidden_layers=1, num_attention_heads=6,
                      num_key_value_heads=3, head_dim=8)
    w = torch.randn(3 * 8, 5)
    permuted = permute_qk("blk.0.attn_k.weight", w, cfg)
    assert torch.equal(permuted, torch.from_numpy(llama_cpp_permute(w.numpy(), 3)))
    assert torch.equal(unpermute_qk("blk.0.attn_k.weight", permuted, cfg), w)
    assert torch.equal(permute_qk("blk.0.attn_v.weight", w, cfg), w)


def test_storage_types():
    assert storage_type(torch.zeros(64), Q.Q8_0) == Q.F32              # norms stay F32
    assert storage_type(torch.zeros(8, 64), Q.Q8_0) == Q.Q8_0
    assert storage_type(torch.zeros(8, 48), Q.Q8_0) == Q.F16           # rows not in 32-blocks


def test_errors_leave_no_file(hf_checkpoints, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    with pytest.raises(ConfigError, match="unknown GGUF dtype 'q4_k'"):
        export_gguf(hf_checkpoints["gqa"], out, "q4_k")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf_checkpoints["gqa"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    spec = json.loads((broken / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True          # llama.cpp cannot do this
    (broken / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="no llama.cpp equivalent"):
        export_gguf(broken, out)
    (broken / "tokenizer.json").unlink()
    assert main(["export-gguf", str(broken), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tokenizer.json" in err[0]
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".*partial")) == []


def test_cli_export(hf_checkpoints, tmp_path, capsys):
    out = tmp_path / "tied.gguf"
    assert main(["export-gguf", str(hf_checkpoints["tied"]), str(out), "--dtype", "bf16",
                 "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == \
        gguf.LlamaFileType.MOSTLY_BF16


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_4bit_export_round_trips_bit_exact(hf_checkpoints, exported, tmp_path, dtype):
    """Linears in llama.cpp's Q4_0/Q4_1 blocks (gguf.quants' port of quantize_row_q4_*_ref),
    token embeddings in Q8_0; kvslim's kept-quantized import decodes exactly what
    gguf.quants.dequantize does, so its logits equal the float import's bit for bit."""
    cfg = ModelConfig.from_dir(hf_checkpoints["gqa"])
    state = load_model(hf_checkpoints["gqa"], dtype=torch.float32).hf_state_dict()
    path = exported("gqa", dtype)
    qtype = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1}[dtype]
    for name, (stored, got) in read_back(path).items():
        if got.ndim == 1:
            continue
        want = gguf_layout(name, state[gguf_names(name)], cfg)
        expect_type = Q.Q8_0 if name in ("token_embd.weight", "output.weight") else qtype
        assert stored == expect_type, name
        ref = gguf.quants.dequantize(gguf.quants.quantize(want, expect_type), expect_type)
        np.testing.assert_array_equal(got, ref.reshape(want.shape), err_msg=name)
    kept = import_gguf(path, tmp_path / "kept", show_progress=False, keep_quantized=True)
    dense = import_gguf(path, tmp_path / "float", show_progress=False)
    assert json.loads((kept / "config.json").read_text())["quantization_config"]["embedding"]
    with torch.no_grad():
        assert torch.equal(load_model(kept, dtype=torch.float32).logits(IDS),
                           load_model(dense, dtype=torch.float32).logits(IDS))


def gguf_names(name: str) -> str:
    return {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
            "output_norm.weight": "model.norm.weight"}.get(name) or hf_tensor_name(name)


def test_cli_outtype_q4_0(hf_checkpoints, tmp_path, capsys):
    out = tmp_path / "q4.gguf"
    assert main(["export-gguf", str(hf_checkpoints["gqa"]), str(out), "--outtype", "q4_0",
                 "--quiet"]) == 0
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == \
        gguf.LlamaFileType.MOSTLY_Q4_0


def test_a_quantized_import_is_refused(tmp_path):
    from gguf_files import write_tiny_gguf
    write_tiny_gguf(tmp_path / "q.gguf", qtype=Q.Q4_0)
    kept = import_gguf(tmp_path / "q.gguf", tmp_path / "kept", show_progress=False,
                       keep_quantized=True)
    with pytest.raises(ConfigError, match="holds quantized weights .gguf.; export-gguf writes"):
        export_gguf(kept, tmp_path / "out.gguf", "q4_0")
    assert not (tmp_path / "out.gguf").exists()


def test_an_architecture_without_an_exporter_is_refused(hf_checkpoints, tmp_path):
    with pytest.raises(ConfigError,
                       match="llama, phi3, qwen2, qwen3, qwen3moe GGUF files: Gemma3ForCausalLM"):
        export_gguf(hf_checkpoints["gemma3"], tmp_path / "g.gguf", "f32", show_progress=False)
    assert list(tmp_path.iterdir()) == []


def qwen3_head_dim_128(root):
    """transformers' GGUF reader builds Qwen3 with its default head_dim, 128 (as every released
    Qwen3 has): a tiny checkpoint with that head size."""
    from checkpoints import hf_config, write_random_checkpoint
    cfg = hf_config("qwen3")
    cfg.head_dim = 128
    return write_random_checkpoint(cfg, root)


@pytest.mark.parametrize("variant,arch", [("qwen2_bias", "qwen2"), ("qwen3", "qwen3"),
                                          ("phi3", "phi3")])
def test_qwen_architectures_round_trip_and_transformers_reads_them(hf_checkpoints, tmp_path,
                                                                   variant, arch):
    """qwen2 / qwen3 / phi3 files: Q/K rows as HF stores them (llama.cpp permutes only for
    `llama`), biases, qwen3's q/k norms, phi3's fused attn_qkv and ffn_up. transformers' own GGUF
    reader is the reference."""
    from transformers import AutoModelForCausalLM
    src = hf_checkpoints[variant] if arch != "qwen3" else qwen3_head_dim_128(tmp_path / "q3")
    path = export_gguf(src, tmp_path / f"{arch}.gguf", "f32", show_progress=False)
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == arch
    ours = load_model(src, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    again = load_model(import_gguf(path, tmp_path / "back", show_progress=False))
    assert again.config.architecture == ours.config.architecture
    with torch.no_grad():
        assert (ref(IDS).logits - ours.logits(IDS)).abs().max().item() <= 1e-5
        assert torch.equal(again.logits(IDS), ours.logits(IDS))


def test_llama3_rope_divisors_import_as_their_scaling(hf_checkpoints, exported, tmp_path):
    """A Llama 3.1-style file carries only rope_freqs; the import finds the llama3 parameters
    that reproduce them, and the model computes what the original does."""
    path = exported("llama3_rope", "f32")
    again = import_gguf(path, tmp_path / "back", show_progress=False)
    cfg, original = ModelConfig.from_dir(again), ModelConfig.from_dir(hf_checkpoints["llama3_rope"])
    assert cfg.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                               rope_inv_freq(cfg.head_dim, cfg.rope_theta, original.rope_scaling))
    with torch.no_grad():
        torch.testing.assert_close(load_model(again).logits(IDS),
                                   load_model(hf_checkpoints["llama3_rope"]).logits(IDS),
                                   atol=1e-5, rtol=0)


def test_llama31_divisors_are_recognised_and_others_refused():
    from kvslim.formats.gguf.rope import llama3_scaling_from_divisors
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    divisors = rope_inv_freq(128, 500000.0, None) / rope_inv_freq(128, 500000.0, llama31)
    assert llama3_scaling_from_divisors(divisors, 128, 500000.0) == llama31
    assert llama3_scaling_from_divisors(divisors * 1.1, 128, 500000.0) is None
