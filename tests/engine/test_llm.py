"""The offline API: generate (order, per-prompt params), chat, stream, stats, bad input."""
import pytest

from engine_helpers import GREEDY
from kvslim import LLM, SamplingParams
from kvslim.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(hf_checkpoints):
    return LLM(str(hf_checkpoints["gqa"]), kv_cache_memory="4MiB", dtype="float32",
               device="cpu")


def test_generate_keeps_prompt_order_and_params(llm):
    prompts = ["In the beginning", [5, 6, 7, 8], "The kernel"]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 9, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    assert outs[0].prompt == "In the beginning" and outs[1].prompt_token_ids == [5, 6, 7, 8]
    alone = llm.generate("In the beginning", params[0], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.kv_cache_stats().num_used_blocks == 0


def test_stream_yields_the_same_text_as_generate(llm):
    params = SamplingParams(max_tokens=12, **GREEDY)
    text = llm.generate("It is a truth", params, use_tqdm=False)[0].outputs[0].text
    assert "".join(llm.stream("It is a truth", params)) == text
    assert llm.kv_cache_stats().num_used_blocks == 0


def test_abandoned_stream_frees_its_blocks(llm):
    stream = llm.stream("It is a truth", SamplingParams(max_tokens=50, **GREEDY))
    next(stream)
    stream.close()
    assert llm.kv_cache_stats().num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_chat_applies_the_template(llm):
    conv = [{"role": "user", "content": "hello"}]
    out = llm.chat(conv, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_a_bad_prompt_adds_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", []], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams()] * 2, use_tqdm=False)
