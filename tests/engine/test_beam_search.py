"""Beam search in the engine against a plain-torch reference over transformers' model (full
recompute, no cache): the same hypotheses token for token for widths 1-4, length penalties and
early-stopping rules, batched with other requests and under preemption; width 1 is greedy;
beams share KV blocks and none leak after the end or an abort; best_of > n keeps the best."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.engine_helpers import engine, run
from kvslim.engine.beam_search import beam_score
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError

PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [3, 1, 4, 1, 5], list(range(40, 60))]


def reference(model, prompt, width, max_tokens, length_penalty, early_stopping, ends):
    """The rule of engine/beam_search.py, written plainly: [(tokens, cumulative logprob)]."""
    beams, hyps = [(0.0, [])], []

    def keep(tokens, cum, length):
        hyps.append((beam_score(cum, length, length_penalty), tokens, cum))
        hyps.sort(key=lambda h: -h[0])
        del hyps[width:]

    for step in range(max_tokens):
        cands = []
        for i, (cum, gen) in enumerate(beams):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + gen])).logits[0, -1].float()
            values, ids = torch.log_softmax(logits, -1).topk(2 * width)
            cands += [(cum + v, i, k, t) for k, (t, v) in enumerate(zip(ids.tolist(),
                                                                        values.tolist()))]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = []
        for rank, (score, i, _, t) in enumerate(cands):
            if t in ends:
                if rank < width:
                    keep(beams[i][1] + [t], score, len(beams[i][1]))
                continue
            chosen.append((score, beams[i][1] + [t]))
            if len(chosen) == width:
                break
        if not chosen:
            break
        length = step + 1
        if len(hyps) >= width:
            if early_stopping is True:
                break
            at = max_tokens if early_stopping == "never" and length_penalty > 0 else length
            if hyps[-1][0] >= beam_score(chosen[0][0], at, length_penalty):
                break
        beams = chosen
        if length == max_tokens:
            for cum, gen in beams:
                keep(gen, cum, len(gen))
    return [(tokens, cum) for _, tokens, cum in hyps]


@pytest.fixture(scope="module")
def hf_model(hf_checkpoints):
    return AutoModelForCausalLM.from_pretrained(hf_checkpoints["gqa"], torch_dtype=torch.float32
                                                ).eval()


@pytest.fixture(scope="module")
def ends(hf_checkpoints):
    """Tokens the model often writes, made stop tokens so that hypotheses end early."""
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    free = run(eng, PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [free[0].outputs[0].token_ids[3], free[1].outputs[0].token_ids[8]]


def beam(width, n=None, max_tokens=10, **extra):
    return SamplingParams(use_beam_search=True, best_of=width, n=n or width,
                          max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)


@pytest.mark.parametrize("width, length_penalty, early_stopping", [
    (4, 1.0, False), (4, 0.0, True), (4, 2.0, "never"), (3, -0.5, False), (2, 1.0, True)])
def test_hypotheses_equal_the_reference(hf_checkpoints, hf_model, ends, width, length_penalty,
                                        early_stopping):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    params = beam(width, length_penalty=length_penalty, early_stopping=early_stopping,
                  stop_token_ids=ends)
    outs = run(eng, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        expected = reference(hf_model, prompt, width, 10, length_penalty, early_stopping,
                             set(ends))
        got = [(c.token_ids, c.cumulative_logprob) for c in out.outputs]
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert [c for _, c in got] == pytest.approx([c for _, c in expected], abs=1e-3)
    if length_penalty <= 1.0:                  # short hypotheses can win: some end early
        assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)


def test_width_one_is_greedy_and_batching_or_preemption_change_nothing(hf_checkpoints, ends):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    greedy = run(eng, PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    one = run(eng, PROMPTS, beam(1, early_stopping=True))
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in greedy]
    alone = [run(eng, [p], beam(4, n=2, stop_token_ids=ends))[0] for p in PROMPTS]
    mixed = [beam(4, n=2, stop_token_ids=ends) if i < 3 else
             SamplingParams(max_tokens=12, temperature=0.8, seed=i) for i in range(6)]
    together = run(eng, PROMPTS + PROMPTS, mixed)[:3]
    key = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]   # noqa: E731
    assert key(together) == key(alone)
    tight = engine(hf_checkpoints["gqa"], block_size=4,
                   kv_cache_memory=20 * eng.runner.bytes_per_block)
    assert key(run(tight, PROMPTS, beam(4, n=2, stop_token_ids=ends))) == key(alone)
    assert tight.kv_cache_stats().num_preemptions > 0


def test_beams_share_blocks_and_free_them(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    request = eng.add_request(PROMPTS[0], beam(4, max_tokens=30))
    for _ in range(6):
        eng.step()
    beams = eng.requests[request].seqs
    assert len(beams) == 4
    shared = [b for b in range(eng.block_manager.num_blocks)
              if eng.block_manager.blocks[b].ref_count > 1]
    assert len(shared) >= len(PROMPTS[0]) // 4         # the prompt's blocks, at least
    tables = [set(s.block_table) for s in beams]
    assert set.intersection(*tables)
    eng.abort_request(request)
    assert eng.kv_cache_stats().num_used_blocks == 0
    assert not eng.beams.groups and not eng.runner.sampler.penalties


def test_best_of_returns_the_n_most_likely(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    params = SamplingParams(n=2, best_of=6, max_tokens=8, temperature=1.0, seed=5,
                            ignore_eos=True)
    best = run(eng, PROMPTS[:1], params)[0].outputs
    every = run(eng, PROMPTS[:1], SamplingParams(n=6, max_tokens=8, temperature=1.0, seed=5,
                                                 ignore_eos=True, logprobs=0))[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]


@pytest.mark.parametrize("params, param, message", [
    (dict(use_beam_search=True, best_of=9), "best_of", "beam width=9 exceeds"),
    (dict(use_beam_search=True, stop=["x"]), "use_beam_search", "stop strings"),
    (dict(use_beam_search=True, structured_outputs={"regex": "a"}), "use_beam_search",
     "structured outputs"),
    (dict(n=3, best_of=2), "best_of", "best_of must be an integer >= n"),
    (dict(use_beam_search=True, early_stopping="sometimes"), "early_stopping", "never"),
])
def test_bad_beam_parameters_name_the_field(hf_checkpoints, params, param, message):
    eng = engine(hf_checkpoints["gqa"], block_size=4, max_num_seqs=8)
    with pytest.raises(InvalidRequestError, match=message) as e:
        eng.add_request(PROMPTS[0], SamplingParams(**params))
    assert e.value.param == param


def test_llm_beam_search_is_the_engines(hf_checkpoints):
    from kvslim.engine.llm import LLM
    llm = LLM(str(hf_checkpoints["gqa"]), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    out = llm.beam_search(PROMPTS[:2], beam_width=3, max_tokens=6, ignore_eos=True,
                          use_tqdm=False)
    eng = engine(hf_checkpoints["gqa"], block_size=16)
    expected = run(eng, PROMPTS[:2], beam(3, max_tokens=6))
    assert [[c.token_ids for c in o.outputs] for o in out] == \
        [[c.token_ids for c in o.outputs] for o in expected]
    assert len(out[0].outputs) == 3


def test_a_beam_search_counts_its_width_against_max_num_seqs(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4, max_num_seqs=6)
    ids = [eng.add_request(p, beam(4, max_tokens=8)) for p in PROMPTS[:2]]
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.num_running)
        assert eng.num_running <= 6
    assert peak == 4                        # the second search waited for the first
    assert ids and eng.kv_cache_stats().num_used_blocks == 0
