"""The tool-call formats by name (`kvslim serve --tool-call-parser`), and "auto": the format the
model's chat template speaks, where exactly one format's markers appear in it, else Hermes —
for a template that knows no tools (SmolLM2's, Gemma 3's) kvslim then describes the tools in
the Hermes format itself."""
from __future__ import annotations

from kvslim.errors import ConfigError
from kvslim.tools import hermes, llama3_json, mistral
from kvslim.tools.format import ToolFormat

# qwen3: Qwen2.5's and Qwen3's templates render and expect exactly the Hermes format.
FORMATS: dict[str, ToolFormat] = {"hermes": hermes.FORMAT, "llama3_json": llama3_json.FORMAT,
                                  "mistral": mistral.FORMAT, "qwen3": hermes.FORMAT}
PARSER_CHOICES = ("auto", *FORMATS)


def tool_format(name: str, chat_template: str | None) -> ToolFormat:
    """The format `--tool-call-parser name` means for a model with this chat template."""
    if name != "auto":
        if name not in FORMATS:
            raise ConfigError(f"unknown tool-call parser {name!r}; one of "
                              f"{', '.join(PARSER_CHOICES)}")
        return FORMATS[name]
    spoken = {f.name: f for f in FORMATS.values() if f.spoken_by(chat_template)}
    return next(iter(spoken.values())) if len(spoken) == 1 else hermes.FORMAT
