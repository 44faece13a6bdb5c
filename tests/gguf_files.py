"""Tiny GGUF files written with gguf.GGUFWriter the way llama.cpp's converter writes them (Q/K rows
permuted, HF [out, in] arrays), with the HF-layout weights they should import back to."""
from __future__ import annotations

import contextlib
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from kvslim.formats.gguf.tokenizer import byte_alphabet

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 64, 2
HEAD_DIM = HIDDEN // HEADS

LAYER_SHAPES = {
    "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
}
HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def tiny_tokens() -> list[str]:
    return SPECIALS + list(byte_alphabet().values()) + [m.replace(" ", "") for m in MERGES]


# A SentencePiece (llama.cpp "llama") vocabulary as Llama 2 / Mistral files carry it: <unk>, <s>,
# </s>, 256 byte-fallback tokens, then pieces with "▁" for a space, scored best-first.
SPM_PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "t", "▁t", "▁h", "he",
              "ll", "▁he", "▁the", "▁hell", "▁hello", "▁w", "or",
              "▁wor", "ld", "▁world", "in", "▁in", "a", "▁a", "n", "▁an",
              "▁and", "s", "i", "c"]


def spm_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types: 2 unknown, 3 control, 6 byte, 1 normal)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    return tokens, scores, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to HF Q/K rows (the transform kvslim undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(array to hand to GGUFWriter, the float32 values it decodes back to)."""
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    q = gguf.quants.quantize(w, qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(w.shape)


# Bytes per block and where the float16 fields sit, for random K-quant blocks (gguf.quants
# cannot quantize to them): any byte pattern is a valid block once its float16 fields are finite.
K_BLOCKS = {Q.Q4_K: (144, (0, 2)), Q.Q6_K: (210, (208,))}


def random_blocks(rows: int, cols: int, qtype: Q, rng) -> np.ndarray:
    """Random raw blocks of a K-quant type [rows, bytes], with small positive d (and dmin)."""
    size, f16_at = K_BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scale = 1e-3 if qtype == Q.Q4_K else 2e-4
    d = (scale * (0.5 + rng.random((rows, cols // 256, 1)))).astype(np.float16)
    for at in f16_at:                   # Q4_K: dmin = d
        raw[..., at:at + 2] = d.view(np.uint8)
    if qtype == Q.Q4_K:
        raw[..., 4:16] = q4_k_scales(rng.integers(1, 9, size=(rows, cols // 256, 8)))
    return raw.reshape(rows, -1)


def q4_k_scales(sc: np.ndarray) -> np.ndarray:
    """Q4_K's 12 bytes of 6-bit sub-block scales and mins, with min = round(7.5 sc) so each
    sub-block's weights d * sc * (q - 7.5) are centred, as a real quantizer's roughly are."""
    mn = np.round(7.5 * sc).astype(np.uint8)
    sc = sc.astype(np.uint8)
    out = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def write_tiny_gguf(path: Path, arch: str = "llama", qtype: Q = Q.F32, tied: bool = False,
                    add_bos: bool | None = False, seed: int = 0, vocab: str = "gpt2",
                    types: dict[str, Q] | None = None, hidden: int = HIDDEN, ffn: int = FFN
                    ) -> dict[str, np.ndarray]:
    """Write a 2-layer GQA model with a byte-level BPE ("gpt2") or SentencePiece ("llama")
    vocabulary; return the HF state dict (float32) it should import to. add_bos=None leaves
    the flag out, as older files do. `types` overrides qtype per tensor ("attn_v",
    "token_embd", "output", ...); Q4_K and Q6_K tensors are random blocks (hidden and ffn must
    then be multiples of 256)."""
    rng = np.random.default_rng(seed)
    types = types or {}
    head_dim = hidden // HEADS
    shapes = {"attn_q": (HEADS * head_dim, hidden), "attn_k": (KV_HEADS * head_dim, hidden),
              "attn_v": (KV_HEADS * head_dim, hidden), "attn_output": (hidden, HEADS * head_dim),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    tokens = tiny_tokens() if vocab == "gpt2" else spm_vocabulary()[0]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(vocab)
    w.add_token_list(tokens)
    if vocab == "gpt2":
        w.add_tokenizer_pre("default")
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
        w.add_token_merges(MERGES)
    else:
        _, scores, token_types = spm_vocabulary()
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    expected = {}

    def add(gguf_name: str, hf_name: str, value: np.ndarray, permute_heads: int = 0) -> None:
        value = value.astype(np.float32)
        kind = types.get(gguf_name.split(".")[-2], qtype) if value.ndim == 2 else Q.F32
        if kind in K_BLOCKS:
            raw = random_blocks(*value.shape, kind, rng)
            expected[hf_name] = gguf.quants.dequantize(raw, kind).reshape(value.shape)
            w.add_tensor(gguf_name, llama_cpp_permute(raw, permute_heads) if permute_heads
                         else raw, raw_dtype=kind)
            return
        data, _ = stored(llama_cpp_permute(value, permute_heads) if permute_heads else value, kind)
        quantized = data.dtype == np.uint8
        w.add_tensor(gguf_name, data, raw_dtype=kind if quantized else None)
        # Rows are quantized independently, so reordering rows commutes with storage: the
        # expected weight is the unpermuted value as storage decodes it.
        expected[hf_name] = stored(value, kind)[1]

    add("token_embd.weight", "model.embed_tokens.weight", rng.normal(size=(len(tokens), hidden)))
    for i in range(LAYERS):
        for part, shape in shapes.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part, 0)
            add(f"blk.{i}.{part}.weight", f"model.layers.{i}.{HF_NAMES[part]}.weight",
                rng.normal(size=shape) * 0.2, heads)
        for part in ("attn_norm", "ffn_norm"):
            add(f"blk.{i}.{part}.weight", f"model.layers.{i}.{HF_NAMES[part]}.weight",
                1 + 0.1 * rng.normal(size=hidden))
    add("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.normal(size=hidden))
    if not tied:
        add("output.weight", "lm_head.weight", rng.normal(size=(len(tokens), hidden)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, each GGUF file is parsed once by `gguf.GGUFReader` and that reader is
    shared: transformers parses a file anew for its config, its weights and its tokenizer, about
    30 s each for Gemma 3's 262k-token vocabulary here. The reader is read-only (a memory map),
    so what transformers builds from it is the same. Its metadata, which transformers decodes
    field by field for the config and again for the tokenizer, is decoded once too (each caller
    gets its own copy)."""
    import copy

    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    original, original_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers, metadata = {}, {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_load(path, return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = original_load(path, False)
        return copy.deepcopy(metadata[key])
    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = shared, load_once
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = original, original_load
