"""--tool-call-parser: the names the server offers are the registry's; "auto" reads the format
from each family's own chat template, and falls back to Hermes where the template speaks none
or several."""
from dataclasses import fields

import pytest

from kvslim.errors import ConfigError
from kvslim.server.context import ServerOptions
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.tools import hermes, plain_json, tool_calls_list
from kvslim.tools.registry import FORMATS, PARSER_CHOICES, tool_format
from tool_checks import TEMPLATES


@pytest.mark.parametrize("template, expected", [
    ("llama3.1_instruct.jinja", plain_json.FORMAT),
    ("mistral_v0.3_instruct.jinja", tool_calls_list.FORMAT),
    ("mistral_small_3.2.jinja", tool_calls_list.FORMAT),
    ("qwen2.5_instruct.jinja", hermes.FORMAT),
    ("qwen3.jinja", hermes.FORMAT),
])
def test_auto_reads_the_family_templates(template, expected):
    assert tool_format("auto", (TEMPLATES / template).read_text()) is expected


def test_auto_without_python_tag_still_reads_llama():
    # Llama 3.2's template has Meta's JSON instructions but no built-in tools' python tag.
    text = (TEMPLATES / "llama3.1_instruct.jinja").read_text()
    assert tool_format("auto", text.replace(plain_json.PYTHON_TAG, "")) is plain_json.FORMAT


def test_auto_falls_back_to_hermes(smollm2_dir):
    smol = Tokenizer.from_dir(smollm2_dir).chat_template
    assert smol and tool_format("auto", smol) is hermes.FORMAT          # knows no tools
    assert tool_format("auto", None) is hermes.FORMAT
    both = (TEMPLATES / "qwen3.jinja").read_text() + tool_calls_list.TOOL_CALLS
    assert tool_format("auto", both) is hermes.FORMAT                   # two formats: unclear


def test_named_parsers_override_the_template():
    llama = (TEMPLATES / "llama3.1_instruct.jinja").read_text()
    assert {name: tool_format(name, llama) for name in FORMATS} == {
        "hermes": hermes.FORMAT, "llama3_json": plain_json.FORMAT, "mistral": tool_calls_list.FORMAT,
        "qwen3": hermes.FORMAT}
    with pytest.raises(ConfigError, match="unknown tool-call parser 'pythonic'"):
        tool_format("pythonic", llama)


def test_the_server_flag_offers_exactly_the_registry():
    option = next(f for f in fields(ServerOptions) if f.name == "tool_call_parser")
    assert option.default == "auto" and option.metadata["choices"] == PARSER_CHOICES
    assert PARSER_CHOICES == ("auto", "hermes", "llama3_json", "mistral", "qwen3")
