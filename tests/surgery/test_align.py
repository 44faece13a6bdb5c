"""The `align` conversion recovers a GQA model hidden inside an MHA one.

The MHA model is built from a GQA model by giving every query head its own copy of its KV head,
rotated by a random rotation the attention output cannot see (per RoPE frequency pair for keys,
any orthogonal matrix for values), and shuffling the heads. Its logits equal the GQA model's.
Converting it back must find the right groups, undo the rotations and give the GQA model's
logits again; mean pooling, which averages heads in unrelated bases, cannot."""
import math

import torch

from checkpoints import VOCAB
from kvslim.formats.loader import load_model
from kvslim.formats.writer import copy_tokenizer_files, save_model
from kvslim.surgery.align import rotate_pairs
from kvslim.surgery.convert import convert_to_gqa

IDS = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(5))


def hidden_gqa_as_mha(gqa_dir, out_dir, seed=0):
    model = load_model(gqa_dir, dtype=torch.float32)
    cfg = model.config
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(h, generator=g).tolist()            # new head i = old query head perm[i]
    state = {k: v.clone() for k, v in model.hf_state_dict().items()}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn."
        q = state[p + "q_proj.weight"].reshape(h, d, -1)
        k = state[p + "k_proj.weight"].reshape(kv, d, -1)
        v = state[p + "v_proj.weight"].reshape(kv, d, -1)
        o = state[p + "o_proj.weight"].reshape(-1, h, d)
        new_q, new_k, new_v, new_o = [], [], [], []
        for old in perm:
            src = old // (h // kv)
            phase = torch.rand(d // 2, generator=g) * 2 * math.pi
            rot = torch.linalg.qr(torch.randn(d, d, generator=g))[0]     # orthogonal
            new_q.append(rotate_pairs(q[old], phase, 0))
            new_k.append(rotate_pairs(k[src], phase, 0))
            new_v.append(rot.T @ v[src])                       # V_h = V_src R
            new_o.append(o[:, old] @ rot)                      # O_h = O R
        state[p + "q_proj.weight"] = torch.cat(new_q)
        state[p + "k_proj.weight"] = torch.cat(new_k)
        state[p + "v_proj.weight"] = torch.cat(new_v)
        state[p + "o_proj.weight"] = torch.stack(new_o, dim=1).reshape(o.shape[0], -1)
    save_model(state, cfg.replace(num_key_value_heads=h), out_dir)
    copy_tokenizer_files(gqa_dir, out_dir)
    return out_dir


def logits(path):
    with torch.no_grad():
        return load_model(path, dtype=torch.float32).logits(IDS)


def test_align_recovers_the_hidden_gqa_model(hf_checkpoints, tmp_path, calib_file):
    gqa = hf_checkpoints["gqa"]                                # 8 query heads over 2 KV heads
    mha = hidden_gqa_as_mha(gqa, tmp_path / "mha")
    target = logits(gqa)
    torch.testing.assert_close(logits(mha), target, atol=1e-4, rtol=0)   # same function
    aligned = convert_to_gqa(mha, tmp_path / "align", 2, "align", calib=calib_file,
                             calib_samples=4, calib_seq_len=48, show_progress=False)
    mean = convert_to_gqa(mha, tmp_path / "mean", 2, "mean", show_progress=False)
    err_align = (logits(aligned) - target).abs().max().item()
    err_mean = (logits(mean) - target).abs().max().item()
    assert err_align < 1e-3, err_align
    assert err_mean > 100 * err_align


def test_align_to_as_many_heads_is_exact(hf_checkpoints, tmp_path, calib_file):
    src = hf_checkpoints["qwen2_bias"]                         # biases and GQA source
    dst = convert_to_gqa(src, tmp_path / "same", 2, "align", calib=calib_file, calib_samples=2,
                         calib_seq_len=32, show_progress=False)
    assert torch.equal(logits(src), logits(dst))
