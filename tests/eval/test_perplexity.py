"""kvslim ppl against the same sliding-window computation done with transformers."""
import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.eval.perplexity import perplexity, windows


def hf_sliding_window_ppl(model, ids: torch.Tensor, context: int, stride: int) -> float:
    """The recipe of the transformers documentation ("Perplexity of fixed-length models")."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + context, ids.numel())
        trg_len = end - prev_end
        input_ids = ids[None, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        num_loss_tokens = int((target_ids != -100).sum()) - 1
        nll_sum += loss.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end = end
        if end == ids.numel():
            break
    return math.exp(nll_sum / n_tokens)


@pytest.mark.parametrize("context,stride", [(64, 32), (48, 48), (100, 17)])
def test_matches_transformers(hf_checkpoints, calib_file, context, stride):
    path = hf_checkpoints["gqa"]
    ids = Tokenizer.from_dir(path).encode(calib_file.read_text(), add_special_tokens=False)[:700]
    ours = perplexity(load_model(path, dtype=torch.float32), ids, context, stride,
                      show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_sliding_window_ppl(hf, torch.tensor(ids), context, stride)
    assert abs(ours.perplexity - ref) / ref < 1e-3
    # With stride < context every token but the first is scored; with stride == context each
    # window's first token has no context and is skipped, as in the transformers recipe.
    skipped = 0 if stride < context else len(windows(len(ids), context, stride)) - 1
    assert ours.num_tokens == len(ids) - 1 - skipped


def test_every_token_after_the_first_is_scored_once():
    for n, context, stride in [(10, 4, 2), (17, 5, 4), (3, 8, 4), (100, 64, 1)]:
        plan = windows(n, context, stride)
        assert sum(s for _, _, s in plan) == n - 1
        assert all(end - begin <= context and s < end - begin for begin, end, s in plan)


def test_bad_arguments():
    with pytest.raises(KvslimError, match="stride"):
        windows(10, 4, 8)
    with pytest.raises(KvslimError, match="at least 2 tokens"):
        perplexity(None, [5], 4, 2)


def test_cli_json(hf_checkpoints, calib_file):
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "ppl", str(hf_checkpoints["gqa"]),
                        "--data", str(calib_file), "--context", "64", "--stride", "32",
                        "--max-tokens", "300", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["num_tokens"] == 299 and result["perplexity"] > 1


def test_bos_goes_before_every_window_unscored(hf_checkpoints):
    """A tokenizer that prepends BOS (Gemma, Llama 2) gets it before every window: the same
    tokens are scored, each window's logits computed after BOS."""
    model = load_model(hf_checkpoints["gqa"], dtype=torch.float32)
    tokens = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(2))
    plain = perplexity(model, tokens.numpy(), 32, 16, show_progress=False)
    with_bos = perplexity(model, tokens.numpy(), 32, 16, show_progress=False, bos_token_id=1)
    assert with_bos.num_tokens == plain.num_tokens == 69
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, scored in windows(70, 32, 16):
            ids = torch.cat([torch.tensor([1]), tokens[begin:end]])[None]
            logp = torch.log_softmax(model.logits(ids)[0].float(), -1)
            for t in range(end - begin - scored, end - begin):     # window position of a target
                nll -= float(logp[t, tokens[begin + t]])
                count += 1
    assert count == 69 and with_bos.nll == pytest.approx(nll / count, rel=1e-5)
    assert with_bos.nll != pytest.approx(plain.nll, rel=1e-3)
