"""Lookahead decoding in the engine: greedy output token-identical to plain decoding on random
checkpoints (GQA, MQA, sliding-window layers), batched and alone, under preemption (a tiny cache)
and chunked prefill (a tight token budget); the Jacobi window's rows computed exactly as a dense
causal forward over each row's path computes them; state forgotten with its sequences; seeded
sampling reproducible; options that cannot be served refused before serving."""
import pytest
import torch

from engine.engine_helpers import GREEDY, engine, run, tokens
from engine.speculative.test_spec_engine import PROMPTS
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError


def lookahead(window=3, ngram=3, guesses=3, **extra) -> dict:
    """At every batch size (the default stops above one sequence)."""
    extra.setdefault("disable_by_batch_size", None)
    return dict(method="lookahead", window=window, ngram=ngram, guesses=guesses, **extra)


def greedy_equals_plain(model, speculative: dict, cache: str = "ample", **config):
    """Asserts identical greedy output, batched and alone; returns the speculating engine."""
    params = SamplingParams(max_tokens=40, **GREEDY)
    config.setdefault("kv_cache_memory", "8MiB")
    if cache == "tiny":                   # 24 blocks of 4 tokens: preemptions must happen
        config["kv_cache_memory"] = 24 * engine(model, block_size=4).runner.bytes_per_block
    plain = engine(model, block_size=4, **config)
    fast = engine(model, block_size=4, speculative=speculative, **config)
    expected = tokens(run(plain, PROMPTS, params))
    assert tokens(run(fast, PROMPTS, params)) == expected
    assert [tokens(run(fast, [p], params))[0] for p in PROMPTS] == expected
    stats = fast.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if cache == "tiny":
        assert fast.kv_cache_stats().num_preemptions > 0
    assert not fast.spec.lookahead.states and not fast.runner.tree_tokens.rows
    return fast


@pytest.mark.parametrize("variant", ["gqa", "mqa"])
@pytest.mark.parametrize("cache", ["ample", "tiny"])
def test_greedy_output_equals_plain_decoding(hf_checkpoints, variant, cache):
    greedy_equals_plain(hf_checkpoints[variant], lookahead(), cache)


@pytest.mark.parametrize("shape", [(1, 2, 0), (4, 2, 2), (2, 4, 1), (5, 3, 5)],
                         ids=["jacobi-2gram", "wide-2gram", "deep", "wide"])
def test_window_shapes_keep_greedy_output(hf_checkpoints, shape):
    w, n, g = shape
    greedy_equals_plain(hf_checkpoints["gqa"], lookahead(w, n, g))


def test_sliding_window_layers_keep_greedy_output_and_bound_the_depth(hf_checkpoints):
    """Gemma 3's local layers (window 7) between global ones: the whole tree, lookahead
    branch included, must lie inside the window."""
    model = hf_checkpoints["gemma3"]
    greedy_equals_plain(model, lookahead(3, 3, 2))
    with pytest.raises(KvslimError, match="num_speculative_tokens 7 reaches the model's "
                                          "sliding window of 7"):
        engine(model, speculative=lookahead(7, 3, 1))


def test_chunked_prefill_and_a_tight_token_budget(hf_checkpoints):
    """Prompts split over steps, trees cut to the step's token budget (their lookahead
    columns with them)."""
    greedy_equals_plain(hf_checkpoints["gqa"], lookahead(4, 3, 3), max_num_batched_tokens=9)


def test_tree_rows_match_a_dense_forward_over_their_paths(hf_checkpoints):
    """Every row of a lookahead tree (verification n-grams and the Jacobi window's columns)
    reads the sequence and its own path only, at the position of its depth: the greedy token
    the runner keeps for it is the one a dense causal forward (transformers) over the
    sequence + that path gives."""
    from transformers import AutoModelForCausalLM
    model = hf_checkpoints["gqa"]
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    fast = engine(model, block_size=4, speculative=lookahead(4, 3, 3))
    steps = []
    execute = fast.runner.execute

    def spy(out, *args, **kwargs):
        trees = [(list(e.seq.token_ids), e.draft_token_ids, e.draft_parents)
                 for e in out.scheduled if e.draft_parents is not None]
        result = execute(out, *args, **kwargs)
        for (context, drafts, parents), e in zip(trees, [e for e in out.scheduled
                                                          if e.draft_parents is not None]):
            steps.append((context, drafts, parents, fast.runner.tree_tokens.rows[e.seq.seq_id]))
        return result

    fast.runner.execute = spy
    run(fast, PROMPTS[:2], SamplingParams(max_tokens=12, **GREEDY))
    assert len(steps) >= 4
    for context, drafts, parents, kept in steps[:6]:
        assert len(kept) == len(drafts) + 1
        for row in range(len(drafts) + 1):
            path, node = [], row - 1
            while node >= 0:
                path.insert(0, drafts[node])
                node = parents[node]
            with torch.no_grad():
                logits = hf(torch.tensor([context + path])).logits[0, -1]
            assert float(logits[kept[row]]) >= float(logits.max()) - 1e-4, (row, path)


def test_pool_and_window_state_is_forgotten_after_aborts(hf_checkpoints):
    fast = engine(hf_checkpoints["gqa"], block_size=4, speculative=lookahead())
    for i, prompt in enumerate(PROMPTS):
        fast.add_request(prompt, SamplingParams(max_tokens=50, **GREEDY), f"abort-{i}")
    for _ in range(4):
        fast.step()
    assert fast.spec.lookahead.states
    for i in range(len(PROMPTS)):
        fast.abort_request(f"abort-{i}")
    assert fast.kv_cache_stats().num_used_blocks == 0
    assert not fast.spec.lookahead.states and not fast.runner.tree_tokens.rows


def test_seeded_sampling_is_reproducible_and_leaves_no_blocks(hf_checkpoints):
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s) for s in (1, 2)]
    outs = [tokens(run(engine(hf_checkpoints["gqa"], block_size=4, speculative=lookahead()),
                       PROMPTS[:2], params)) for _ in range(2)]
    assert outs[0] == outs[1] and all(len(t) == 20 for t in outs[0])


def test_options_that_cannot_be_served_are_refused(hf_checkpoints):
    model = hf_checkpoints["gqa"]
    with pytest.raises(KvslimError, match="feed up to 67 tokens a step, more than the 63"):
        engine(model, speculative=lookahead(8, 5, 8))
    with pytest.raises(KvslimError, match="lookahead needs window >= 1, ngram >= 2"):
        engine(model, speculative=lookahead(3, 1, 3))
    with pytest.raises(KvslimError, match="differs from the lookahead tree's depth 3"):
        engine(model, speculative=lookahead(num_speculative_tokens=2))
    with pytest.raises(KvslimError, match="method 'lookahead' takes no 'model'"):
        engine(model, speculative=lookahead(model=str(model)))
