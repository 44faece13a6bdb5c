"""StructuredOutputManager: the bitmask against a dense reference, draft rows against stepping one
token at a time, forks, and a matcher's rejection reported for its request alone."""
import pytest
import torch

from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.sequence import Sequence
from kvslim.structured.grammar import GrammarCompiler
from kvslim.structured.manager import StructuredOutputManager, allows, apply_bitmask
from kvslim.structured.params import StructuredOutputsParams
from kvslim.tokenizer.tokenizer import Tokenizer

VOCAB = 320


@pytest.mark.parametrize("vocab", [32, 45, 320, 333])
def test_apply_bitmask_equals_a_dense_mask(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (min(vocab, 320) + 31) // 32               # 333: logits wider than the mask
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64
                            ).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    expected = logits.clone()
    for r in range(3):
        for t in range(vocab):
            if t >= 32 * words or not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
            if t < 32 * words:
                assert allows(bitmask[r], t) == (expected[r, t] != float("-inf"))
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


@pytest.fixture(scope="module")
def tokenizer(hf_checkpoints):
    return Tokenizer.from_dir(hf_checkpoints["gqa"])


def _manager(tokenizer, **constraint):
    compiler = GrammarCompiler(tokenizer, VOCAB, [0])
    manager = StructuredOutputManager(compiler, VOCAB)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    seq = Sequence(request_id="r", token_ids=[1, 2, 3], params=params, block_size=4)
    manager.add_request("r", compiler.compile(params.structured_outputs))
    return manager, seq


def _mask_now(manager, seq, drafts=()):
    manager.start_masks([(seq, list(drafts))])
    return manager.masks()[seq.seq_id]


def test_draft_rows_are_the_masks_after_each_draft_prefix(tokenizer):
    manager, seq = _manager(tokenizer, regex="the (kernel|memory) is [a-z]+\\.")
    path = tokenizer.encode("the kernel is good.", add_special_tokens=False)
    rows = _mask_now(manager, seq, path[:4])
    assert rows.shape[0] == 5
    for i, token in enumerate(path[:4]):
        assert torch.equal(rows[i], _mask_now(manager, seq)[0])   # the state is rolled back
        manager.accept(seq, [token])
        seq.token_ids.append(token)
    assert torch.equal(rows[4], _mask_now(manager, seq)[0])


def test_rows_after_a_forbidden_draft_allow_everything(tokenizer):
    manager, seq = _manager(tokenizer, regex="the kernel")
    path = tokenizer.encode("the kernel", add_special_tokens=False)
    bad = next(t for t in range(1, VOCAB) if not allows(_mask_now(manager, seq)[0], t))
    rows = _mask_now(manager, seq, [bad, path[0]])
    assert not allows(rows[0], bad)
    assert (rows[1:] == -1).all()
    assert torch.equal(_mask_now(manager, seq)[0], rows[0])      # the matcher is unharmed


def test_siblings_of_a_fork_follow_their_own_tokens(tokenizer):
    manager, seq = _manager(tokenizer, choice=["kernel", "memory"])
    k, m = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("kernel", "memory"))
    mask = _mask_now(manager, seq)[0]
    assert allows(mask, k) and allows(mask, m)
    manager.accept(seq, [k, m], num_samples=2)
    sibling = seq.fork(1)
    assert manager.matchers[("r", 0)] is not manager.matchers[("r", 1)]
    assert not manager.take_errors()
    manager.release(seq)
    manager.release(sibling)
    assert not manager.matchers


def test_a_rejected_token_fails_its_request_not_the_step(tokenizer):
    manager, seq = _manager(tokenizer, regex="kernel")
    bad = next(t for t in range(1, VOCAB) if not allows(_mask_now(manager, seq)[0], t))
    manager.accept(seq, [bad])
    errors = manager.take_errors()
    assert list(errors) == ["r"] and "rejected" in errors["r"]
    manager.forget_request("r")
    assert not manager.grammars and not manager.matchers
