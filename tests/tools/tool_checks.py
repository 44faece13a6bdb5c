"""What the tool-format tests share: whether a forcing grammar admits a text (byte by byte, so
any text is a token path), a chat template of a model family rendered through kvslim's own
renderer, and a text fed to a stream parser in every way of cutting it."""
from __future__ import annotations

import json
from pathlib import Path

import llguidance

from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.tools.chat import ToolRequest, encode_chat_with_tools
from kvslim.tools.format import ToolFormat
from kvslim.tools.spec import ToolSpec

TEMPLATES = Path(__file__).parent / "templates"
# The tools every format's tests call.
WEATHER = ToolSpec("get_weather", "weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
TIME = ToolSpec("get_time", "time", {"type": "object", "properties": {"tz": {"type": "string"}},
                                     "required": ["tz"]})
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris, and the time there?"}]


def accepts(grammar: str, text: str) -> bool:
    tok = llguidance.LLTokenizer(_byte_tokenizer_json())
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    ok = m.consume_tokens(list(text.encode())) if not m.is_error() else False
    return ok and m.is_accepting()


def lark(format: ToolFormat, tools: list[ToolSpec], parallel: bool) -> str:
    return llguidance.LLMatcher.grammar_from_lark(format.forcing_grammar(tools, parallel))


def _byte_tokenizer_json() -> str:
    """A tokenizer whose tokens are the 256 bytes: any text is a token path."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, decoders
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _byte_of(char: str) -> int:
    from kvslim.formats.gguf.tokenizer import byte_alphabet
    return {v: k for k, v in byte_alphabet().items()}[char]


def family_tokenizer(tokenizer_dir: Path, template: str, specials: dict[str, str]) -> Tokenizer:
    """The test checkpoint's tokenizer (byte-level: decoding gives back any text) with a
    family's chat template (tests/tools/templates/) and its BOS/EOS strings."""
    tok = Tokenizer.from_dir(tokenizer_dir)
    return Tokenizer(tok.tok, specials, None, (TEMPLATES / template).read_text())


def assistant_turn(tok: Tokenizer, history: list[dict], assistant: dict, tools: list[dict],
                   format: ToolFormat, end: str) -> str:
    """The text the template writes for `assistant`'s turn after `history` — what the model
    is trained to answer after the generation prompt — without its end-of-turn `end` (the
    stop token, which is not part of the answer's text)."""
    request = ToolRequest.of(tools, "auto", format=format)
    prompt, whole = (tok.decode(encode_chat_with_tools(tok, messages, request, generation),
                                skip_special_tokens=False)
                     for messages, generation in ((history, True), (history + [assistant], False)))
    assert whole.startswith(prompt), (prompt, whole)
    turn = whole[len(prompt):]
    assert turn.endswith(end), turn
    return turn[:-len(end)]


def openai_calls(calls: list[tuple[str, dict]], ids: list[str]) -> list[dict]:
    return [{"id": i, "type": "function", "function": {"name": name,
                                                      "arguments": json.dumps(arguments)}}
            for (name, arguments), i in zip(calls, ids)]


def cuts(text: str) -> list[list[str]]:
    """The text one character at a time, and cut in two at every boundary."""
    return [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]


def stream(format: ToolFormat, tools: list[ToolSpec], pieces: list[str]
           ) -> tuple[str, list[tuple[str, str]]]:
    """The text and the (name, arguments) calls a stream parser gives out for these deltas."""
    parser = format.stream_parser(tools)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return ("".join(e for e in events if isinstance(e, str)),
            [(e.name, e.arguments) for e in events if not isinstance(e, str)])
