"""The offline API: which import of a model it runs, generate (order, per-prompt params), chat
(and its reasoning parser), stream, embed, stats, bad input."""
import pytest
from gguf import GGMLQuantizationType as Q

from engine_helpers import GREEDY
from gguf_files import write_tiny_gguf
from kvslim import LLM, SamplingParams
from kvslim.errors import ConfigError, InvalidRequestError
from kvslim.formats import registry
from kvslim.models.config import ModelConfig


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


def test_chat_with_a_reasoning_parser_binds_the_answer_after_the_thinking(llm):
    import json
    from kvslim.reasoning.parser import PROMPT_OPENS
    from kvslim.structured.params import StructuredOutputsParams
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    conv = [{"role": "user", "content": "hello"}]
    bound = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].text
    after = llm.chat(conv, params, use_tqdm=False, reasoning_parser="deepseek_r1")[0]
    reasoning, answer = PROMPT_OPENS.split(after.outputs[0].text)
    assert isinstance(json.loads(bound), dict) and isinstance(json.loads(answer), dict)
    assert reasoning
    with pytest.raises(ConfigError, match="unknown reasoning parser 'nope'"):
        llm.chat(conv, params, use_tqdm=False, reasoning_parser="nope")


def test_a_bad_prompt_adds_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", []], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams()] * 2, use_tqdm=False)


def test_embed_takes_one_prompt_or_several_and_runs_what_the_engine_runs(llm):
    prompts = ["In the beginning", [5, 6, 7, 8]]
    vectors = llm.embed(prompts)
    assert vectors == [o.embedding for o in llm.engine.embed(prompts, "last")]
    for one in prompts:                  # a single prompt, text or ids, is one input
        assert llm.embed(one) == [llm.engine.embed([one])[0].embedding]
    assert llm.embed(prompts, pooling="mean") == [o.embedding
                                                  for o in llm.engine.embed(prompts, "mean")]
    assert [len(v) for v in vectors] == [64, 64] and vectors[0] != vectors[1]
    assert llm.kv_cache_stats().num_used_blocks == 0

@pytest.fixture
def tiny_q4_1(tmp_path, monkeypatch):
    """A tiny Q4_1 GGUF, also standing in for the embedded models' files, in a KVSLIM_HOME of
    its own."""
    monkeypatch.setenv("KVSLIM_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=Q.Q4_1)
    monkeypatch.setattr(registry, "default_model_gguf", lambda: path)
    monkeypatch.setattr(registry, "gemma3_gguf", lambda: path)
    return path


@pytest.mark.parametrize("name", [None, "default", "gemma3-270m", "path"])
def test_a_gguf_model_runs_quantized_unless_a_float_dtype_is_asked(tiny_q4_1, name):
    """What `kvslim generate` runs: the file's blocks at dtype "auto", its float32 import at
    an explicit dtype."""
    model = str(tiny_q4_1) if name == "path" else name
    with LLM(model, device="cpu", kv_cache_memory="1MiB") as llm:
        assert ModelConfig.from_dir(llm.model_dir).quantization.method == "gguf"
    with LLM(model, dtype="float32", device="cpu", kv_cache_memory="1MiB") as llm:
        assert ModelConfig.from_dir(llm.model_dir).quantization is None
    assert tiny_q4_1.parent / "home" / "models" in llm.model_dir.parents     # an import


def test_a_directory_is_taken_as_is(hf_checkpoints):
    path = hf_checkpoints["gqa"]
    with LLM(str(path), device="cpu", kv_cache_memory="1MiB") as llm:
        assert llm.model_dir == path
