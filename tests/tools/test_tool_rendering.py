"""Tools in the prompt: a template that lays tools out itself renders what transformers'
apply_chat_template(tools=...) renders; any other gets kvslim's Hermes system message, with earlier
calls and tool results in the history."""
import json

import pytest
from transformers import PreTrainedTokenizerFast

from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.tools.chat import ToolRequest, encode_chat_with_tools, native_tools

# A Qwen2.5-style template: tools in the system turn, calls as <tool_call> JSON, results as
# user turns with <tool_response>.
QWEN_LIKE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == 'system' and tools %}{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                           "parameters": {"type": "object", "properties": {
                                               "tz": {"type": "string"}}}}}]
HISTORY = [{"role": "user", "content": "What time is it in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "14:00"}]


@pytest.fixture(scope="module")
def tokenizer_dir(hf_checkpoints):
    return hf_checkpoints["gqa"]


def test_a_tool_aware_template_renders_as_transformers_does(tokenizer_dir):
    ours = Tokenizer.from_dir(tokenizer_dir)
    ours.chat_template = QWEN_LIKE
    assert native_tools(ours)
    ids = encode_chat_with_tools(ours, HISTORY, ToolRequest.of(TOOLS, "auto"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    hf_history = [dict(m) for m in HISTORY]
    hf_history[1] = {**HISTORY[1], "tool_calls": [{"type": "function", "function": {
        "name": "get_time", "arguments": {"tz": "CET"}}}]}              # HF's convention
    text = hf.apply_chat_template(hf_history, tools=TOOLS, chat_template=QWEN_LIKE,
                                  tokenize=False, add_generation_prompt=True)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert '"tz": "CET"' in text and "<tool_response>\n14:00" in text


def test_other_templates_get_the_hermes_system_message(tokenizer_dir, smollm2_dir):
    smol = Tokenizer.from_dir(smollm2_dir)
    assert not native_tools(smol)
    text = smol.decode(encode_chat_with_tools(smol, HISTORY, ToolRequest.of(TOOLS, "auto")),
                       skip_special_tokens=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(ToolRequest.of(TOOLS, None).tools[0].openai()) in system
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n14:00\n</tool_response>" in text
    plain = smol.decode(encode_chat_with_tools(smol, HISTORY[:1], ToolRequest.of(None, None)),
                        skip_special_tokens=False)
    assert "# Tools" not in plain and "You are a helpful AI assistant named SmolLM" in plain


def test_llm_chat_forces_and_parses_calls(smollm2_dir):
    from kvslim.engine.llm import LLM
    from kvslim.engine.sampling_params import SamplingParams
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                               "maximum": 9}}, "required": ["n"]}}}]
    out = llm.chat([{"role": "user", "content": "the kernel"}], SamplingParams(
        max_tokens=70, temperature=0), use_tqdm=False, tools=tools, tool_choice="required",
        parallel_tool_calls=False)[0].outputs[0]
    assert [c.name for c in out.tool_calls] == ["pick"]
    assert 0 <= json.loads(out.tool_calls[0].arguments)["n"] <= 9
