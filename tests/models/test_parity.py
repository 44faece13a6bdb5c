"""kvslim's model against HF transformers on the same random checkpoints."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VARIANTS, VOCAB, dense_greedy
from kvslim.formats.loader import load_model

LENGTHS = [23, 9, 17, 1]


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def padded_batch(seed=0):
    """Left-padded batch of sequences of different lengths, and its mask of real tokens."""
    gen = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.bool)
    for row, n in enumerate(LENGTHS):
        ids[row, width - n:] = torch.randint(0, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = True
    return ids, mask


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(hf_checkpoints, variant):
    path = hf_checkpoints[variant]
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = hf_model(path)(ids, attention_mask=mask.long()).logits
        ours = load_model(path, dtype=torch.float32).logits(ids, padding_mask=mask)
    diff = (ref - ours).abs()[mask].max().item()
    assert diff <= 1e-4, f"{variant}: max abs logits diff {diff}"


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa", "qwen2_bias", "llama3_rope"])
def test_unpadded_rows_match_padded(hf_checkpoints, variant):
    """Each sequence alone gives the same logits as inside the padded batch."""
    model = load_model(hf_checkpoints[variant], dtype=torch.float32)
    ids, mask = padded_batch(seed=1)
    with torch.no_grad():
        batched = model.logits(ids, padding_mask=mask)
        for row in range(len(LENGTHS)):
            alone = model.logits(ids[row, mask[row]][None])[0]
            torch.testing.assert_close(batched[row, mask[row]], alone, atol=1e-5, rtol=0)




@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_32_tokens_match_generate(hf_checkpoints, variant):
    path = hf_checkpoints[variant]
    ref_model, ours = hf_model(path), load_model(path, dtype=torch.float32)
    for n in (5, 12):
        prompt = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
        ref = ref_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                 do_sample=False, pad_token_id=0)
        assert dense_greedy(ours, prompt[0].tolist(), 32) == ref[0, n:].tolist()


def test_reduced_precision_runs(hf_checkpoints):
    """bfloat16 and float16 load and stay close to float32 on the GQA checkpoint."""
    path = hf_checkpoints["gqa"]
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        ref = load_model(path, dtype=torch.float32).logits(ids)
        for dtype in (torch.bfloat16, torch.float16):
            model = load_model(path, dtype=dtype)
            assert next(model.parameters()).dtype == dtype
            out = model.logits(ids).float()
            assert out.shape == ref.shape and torch.isfinite(out).all()
            assert (out - ref).abs().max() < 0.15 * ref.abs().max()
