"""Engine behaviour beyond parity: GQA capacity, bad input, seeds, n > 1, aborts, streaming."""
import pytest
import torch

from checkpoints import VOCAB
from engine_helpers import GREEDY, engine, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError, KvslimError

PROMPT = list(range(10, 30))


def test_fewer_kv_heads_give_proportionally_more_blocks(hf_checkpoints):
    budget = 1 << 20
    blocks = {v: engine(hf_checkpoints[v], kv_cache_memory=budget).kv_cache_stats().num_blocks
              for v in ("mha8", "gqa", "mqa")}            # 8 query heads; 8, 2 and 1 KV heads
    assert blocks["gqa"] == 4 * blocks["mha8"] and blocks["mqa"] == 8 * blocks["mha8"]


def peak_running(eng, num_requests, params) -> int:
    for i in range(num_requests):                         # distinct: no prefix-cache sharing
        eng.add_request([i % VOCAB] + PROMPT[1:], params)
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.num_running)
    assert eng.kv_cache_stats().num_used_blocks == 0
    return peak


def test_gqa_holds_h_over_k_times_the_concurrent_sequences(hf_checkpoints):
    params = SamplingParams(max_tokens=8, **GREEDY)      # 28 tokens: 2 blocks per sequence
    common = dict(kv_cache_memory=64 * 16384, max_num_seqs=1024, max_num_batched_tokens=8192)
    mha = peak_running(engine(hf_checkpoints["mha8"], **common), 200, params)
    gqa = peak_running(engine(hf_checkpoints["gqa"], **common), 200, params)
    assert mha in (31, 32)                               # 64 blocks / 2, minus the watermark
    assert gqa >= 4 * mha - 4


@pytest.mark.parametrize("kwargs,param", [
    (dict(prompt=list(range(300))), "prompt"),
    (dict(params=SamplingParams(max_tokens=250)), "max_tokens"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[VOCAB + 5]), "prompt"),
    (dict(params=SamplingParams(logit_bias={VOCAB: 1.0})), "logit_bias"),
    (dict(params=SamplingParams(stop_token_ids=[VOCAB + 1])), "stop_token_ids"),
])
def test_bad_requests_fail_and_the_engine_keeps_serving(hf_checkpoints, kwargs, param):
    eng = engine(hf_checkpoints["gqa"], max_model_len=256)
    good = eng.add_request(PROMPT, SamplingParams(max_tokens=5, **GREEDY))
    eng.step()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(kwargs.get("prompt", PROMPT), kwargs.get("params"))
    assert err.value.param == param
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(outs) == [good] and len(outs[good].outputs[0].token_ids) == 5
    assert eng.kv_cache_stats().num_used_blocks == 0


def test_budget_too_small_for_one_sequence(hf_checkpoints):
    path = hf_checkpoints["gqa"]
    with pytest.raises(KvslimError, match="too small for one block"):
        engine(path, kv_cache_memory=100)
    budget = 4 * engine(path).runner.bytes_per_block                # 64 tokens
    with pytest.raises(KvslimError, match="max_model_len=128 needs more KV cache"):
        engine(path, kv_cache_memory=budget, max_model_len=128)
    eng = engine(path, kv_cache_memory=budget)      # the model's 512 positions: capped to 64
    assert eng.max_model_len == 64
    with pytest.raises(InvalidRequestError, match=r"exceeds max_model_len \(64\)"):
        eng.add_request(PROMPT, SamplingParams(max_tokens=60))
    out = run(eng, [PROMPT], SamplingParams(max_tokens=None, **GREEDY))[0]   # up to the cap
    assert len(out.outputs[0].token_ids) == 64 - len(PROMPT)


def test_seeded_sampling_is_reproducible_across_batches(hf_checkpoints):
    path = hf_checkpoints["gqa"]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42)
    alone = tokens(run(engine(path), [PROMPT], seeded))[0]
    others = [[5, 6, 7] * k for k in range(1, 6)]
    mixed = run(engine(path), others[:2] + [PROMPT] + others[2:],
                [SamplingParams(max_tokens=20, temperature=1.0)] * 2 + [seeded]
                + [SamplingParams(max_tokens=9, temperature=0.7, seed=1)] * 3)
    assert tokens(mixed)[2] == alone
    unseeded = [tokens(run(engine(path, seed=s), [PROMPT], SamplingParams(max_tokens=16)))[0]
                for s in (1, 2)]
    assert unseeded[0] != unseeded[1]


def test_n_completions_share_the_prompt_blocks(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=8)
    eng.add_request(PROMPT, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3))
    eng.step()                                            # prefill, then fork into 4
    family = eng.scheduler.running
    assert len(family) == 4 and len({tuple(s.block_table) for s in family}) == 1
    assert [eng.block_manager.blocks[b].ref_count for b in family[0].block_table] == [4, 4, 4]
    assert eng.kv_cache_stats().num_used_blocks == 3
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in outs[0].outputs)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert eng.kv_cache_stats().num_used_blocks == 0


def test_abort_at_any_time_frees_blocks(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], max_num_seqs=2)
    ids = [eng.add_request(PROMPT, SamplingParams(max_tokens=30, **GREEDY)) for _ in range(3)]
    eng.step()
    eng.step()
    assert eng.abort_request(ids[2])                      # still waiting
    assert eng.abort_request(ids[0])                      # running
    assert not eng.abort_request("no-such-request")
    done = []
    while eng.has_unfinished_requests():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == [ids[1]] and eng.kv_cache_stats().num_used_blocks == 0


def test_stop_strings_and_tokens_end_generation(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"])
    free = run(eng, [PROMPT], SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0]
    stop_token = free.token_ids[5]
    out = run(eng, [PROMPT], SamplingParams(max_tokens=20, stop_token_ids=[stop_token],
                                           **GREEDY))[0].outputs[0]
    first = free.token_ids.index(stop_token)
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    text = free.text
    at = next(i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    stop = text[at:at + 2]
    cut = run(eng, [PROMPT], SamplingParams(max_tokens=20, stop=[stop], **GREEDY))[0]
    assert cut.outputs[0].text == text[:text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop


def test_the_stop_token_stays_out_of_the_text_unless_asked_for(hf_checkpoints):
    """As vLLM: the EOS or stop token that ended an answer is not part of its text (even with
    skip_special_tokens off, where EOS would decode to its marker)."""
    eng = engine(hf_checkpoints["gqa"])
    free = run(eng, [PROMPT], SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0]
    stop_token = free.token_ids[5]
    first = free.token_ids.index(stop_token)
    for keep in (False, True):
        out = run(eng, [PROMPT], SamplingParams(max_tokens=20, stop_token_ids=[stop_token],
                                               include_stop_str_in_output=keep, **GREEDY))
        c = out[0].outputs[0]
        cut = run(eng, [PROMPT], SamplingParams(max_tokens=first + keep, **GREEDY))[0].outputs[0]
        assert c.token_ids == cut.token_ids[:first] + [stop_token] and c.text == cut.text
    eos = eng.eos_token_ids[0]
    out = run(eng, [PROMPT], SamplingParams(max_tokens=5, temperature=0.0, logit_bias={eos: 100.0},
                                           skip_special_tokens=False))[0].outputs[0]
    assert out.token_ids == [eos] and out.text == "" and out.finish_reason == "stop"


def test_streamed_deltas_add_up_to_the_text(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"])
    eng.add_request(PROMPT, SamplingParams(max_tokens=12, logprobs=2, **GREEDY))
    deltas, ids = [], []
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            ids += out.outputs[0].delta_token_ids
            final = out
    c = final.outputs[0]
    assert "".join(deltas) == c.text and ids == c.token_ids
    assert len(c.logprobs) == 12 and all(len(lp.top) == 2 for lp in c.logprobs)
    assert final.metrics.time_to_first_token > 0 and final.metrics.time_per_output_token > 0
