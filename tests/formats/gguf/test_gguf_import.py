"""GGUF import: the real SmolLM2 file against transformers' own GGUF loader, tiny files written
with GGUFWriter for exact weight checks, and the errors for files kvslim cannot use."""
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_files import HEADS, KV_HEADS, gguf_parsed_once, llama_cpp_permute, write_tiny_gguf
from kvslim.errors import ConfigError
from kvslim.models.config import ModelConfig
from kvslim.formats.gguf.importer import hf_tensor_name, import_gguf, unpermute_qk
from kvslim.formats.loader import load_model
from kvslim.tokenizer.tokenizer import Tokenizer

PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "In the beginning God created the heaven and the earth. And the earth was without form",
    "The Linux kernel documentation describes how to configure and build the kernel image",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Short prompts on a 135M model gain little from a second thread, while on a busy machine
    (tests beside a training run) spinning OpenMP threads make each forward ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir, dtype=torch.float32), Tokenizer.from_dir(smollm2_dir)


def prompt_batch(tok: Tokenizer) -> torch.Tensor:
    ids = [tok.encode(p) for p in PROMPTS]
    n = min(len(i) for i in ids)
    return torch.tensor([i[:n] for i in ids])


def test_logits_match_transformers_gguf_loader(smollm2, smollm2_gguf):
    from transformers import AutoModelForCausalLM
    model, tok = smollm2
    ids = prompt_batch(tok)
    assert ids.shape[1] >= 12
    with gguf_parsed_once():                   # its config and its weights: one parse
        ref_model = AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(ids).logits
        ours = model.logits(ids)
    diff = (ref - ours).abs().max().item()
    print(f"SmolLM2 GGUF: max abs logits diff vs transformers = {diff:.3g}")
    assert diff <= 1e-3


def test_greedy_answers_capital_of_france(smollm2):
    model, tok = smollm2
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    prompt_len = len(ids)
    answer = ""
    with torch.no_grad():
        while len(ids) < prompt_len + 12 and "Paris" not in answer:
            hidden = model(torch.tensor([ids]))
            next_id = model.compute_logits(hidden[:, -1]).argmax().item()
            if next_id in tok.eos_token_ids:
                break
            ids.append(next_id)
            answer = tok.decode(ids[prompt_len:])
    assert "Paris" in answer, answer


def test_imported_config(smollm2_dir):
    cfg = ModelConfig.from_dir(smollm2_dir)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.attention_kind == "GQA" and cfg.tie_word_embeddings
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rope_theta) == (49152, 8192, 1e5)
    assert cfg.torch_dtype == "float32"
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_imports_exact_weights(tmp_path, qtype, tied):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=qtype, tied=tied)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False)
    model = load_model(out, dtype=torch.float32)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (HEADS, KV_HEADS)
    assert cfg.tie_word_embeddings == tied
    state = model.hf_state_dict()
    for name, value in expected.items():
        assert torch.equal(state[name], torch.from_numpy(value)), name
    if tied:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert torch.isfinite(model.logits(torch.tensor([[5, 6, 7]]))).all()


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(3 * 8, 5)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 3))
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=24,
                      intermediate_size=8, num_hidden_layers=1, num_attention_heads=6,
                      num_key_value_heads=3, head_dim=8)
    assert torch.equal(unpermute_qk("blk.0.attn_k.weight", permuted, cfg), w)
    assert torch.equal(unpermute_qk("blk.0.attn_v.weight", permuted, cfg), permuted)


def test_tensor_names():
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ConfigError, match="unexpected GGUF tensor 'blk.0.ssm_a'"):
        hf_tensor_name("blk.0.ssm_a")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a GGUF file\n")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        import_gguf(bad, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_truncated_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "out", show_progress=False)


def test_other_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ConfigError) as err:
        import_gguf(tmp_path / "gpt2.gguf", tmp_path / "out", show_progress=False)
    assert str(err.value) == ("gpt2.gguf: GGUF architecture 'gpt2' is not supported; kvslim "
                              "imports llama, qwen2, qwen3, gemma3, phi3, qwen3moe GGUF files")
    assert not (tmp_path / "out").exists()


def test_missing_metadata(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "empty.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="has no 'llama.embedding_length'"):
        import_gguf(tmp_path / "empty.gguf", tmp_path / "out", show_progress=False)


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    """A Llama-2-style file (SentencePiece vocabulary): kvslim's import and transformers' GGUF
    loader give the same ids and the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    write_tiny_gguf(tmp_path / "spm.gguf", vocab="llama", add_bos=None, seed=3)
    out = import_gguf(tmp_path / "spm.gguf", tmp_path / "out", show_progress=False)
    text = "hello world and the world in hello"
    ids = Tokenizer.from_dir(out).encode(text)
    assert ids == AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")(text)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="spm.gguf",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
    ours = load_model(out, dtype=torch.float32).logits(torch.tensor([ids]))
    assert (ours - ref).abs().max().item() <= 1e-4
