"""What a chat answer holds beside its text, by the names vLLM gives the parsers (after the
families that write them): the tool-call formats (`kvslim serve --tool-call-parser`) and the
reasoning conventions (`--reasoning-parser`).

Tool calls "auto": the format the model's chat template speaks, where exactly one format's
markers appear in it, else Hermes — for a template that knows no tools (SmolLM2's, Gemma 3's)
kvslim then describes the tools in the Hermes format itself."""
from __future__ import annotations

from kvslim.errors import ConfigError
from kvslim.reasoning.parser import MODEL_OPENS, PROMPT_OPENS, ReasoningFormat
from kvslim.tools import hermes, plain_json, tool_calls_list
from kvslim.tools.format import ToolFormat

# qwen3: Qwen2.5's and Qwen3's templates render and expect exactly the Hermes format.
FORMATS: dict[str, ToolFormat] = {"hermes": hermes.FORMAT, "llama3_json": plain_json.FORMAT,
                                  "mistral": tool_calls_list.FORMAT, "qwen3": hermes.FORMAT}
PARSER_CHOICES = ("auto", *FORMATS)
# deepseek_r1: R1's template opens <think> in the prompt; qwen3: the model writes it.
REASONING_FORMATS: dict[str, ReasoningFormat] = {"deepseek_r1": PROMPT_OPENS,
                                                 "qwen3": MODEL_OPENS}


def tool_format(name: str, chat_template: str | None) -> ToolFormat:
    """The format `--tool-call-parser name` means for a model with this chat template."""
    if name != "auto":
        if name not in FORMATS:
            raise ConfigError(f"unknown tool-call parser {name!r}; one of "
                              f"{', '.join(PARSER_CHOICES)}")
        return FORMATS[name]
    spoken = {f.name: f for f in FORMATS.values() if f.spoken_by(chat_template)}
    return next(iter(spoken.values())) if len(spoken) == 1 else hermes.FORMAT


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The convention `--reasoning-parser name` means; None: no parser."""
    if name is None:
        return None
    if name not in REASONING_FORMATS:
        raise ConfigError(f"unknown reasoning parser {name!r}; one of "
                          f"{', '.join(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]
