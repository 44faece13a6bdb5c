"""Structured outputs under a reasoning parser: the constraint binds the answer, not the
thinking before it (vLLM's structured outputs with --reasoning-parser).

`wrap_after_reasoning` gives llguidance one grammar for the whole output: the thinking free up
to the first `</think>` (a lazy lexeme, so the first one ends it, as `ReasoningStream` reads it),
then the request's own grammar. Thinking is required where the prompt opens it (PROMPT_OPENS)
and optional where the model opens it itself (MODEL_OPENS). A JSON answer may begin with a few
blanks (the templates write "</think>\\n\\n"); other answers begin right after the tag.

`ThinkingCloser` keeps a JSON answer closable under max_tokens behind its thinking: while the
model thinks, the closing is `</think>` and then the shortest JSON, so a budget about to run out
ends the thinking and still leaves a complete answer. A token may end the thinking inside a
character (its UTF-8 bytes cut), so the closing first completes it: llguidance allows nothing else
there, `</think>` included."""
from __future__ import annotations

import copy
import json

from kvslim.reasoning.parser import END, START, ReasoningFormat, ReasoningStream
from kvslim.structured.json_closer import utf8_tail

ANSWER = "kvslim_answer"                 # the request's grammar, named inside the wrapper
# Blanks before `<think>` and before a JSON answer: bounded alike (a model could write blanks
# until max_tokens), so that after any blanks the answer may still begin.
LEADING_BLANKS = r"/[ \t\r\n]{0,4}/"
# What one free token can add to a closing while the model thinks: the continuation bytes of a
# character it leaves cut (three at most, a token each at worst).
THINKING_GROWTH = 3


def wrap_after_reasoning(grammar: str, fmt: ReasoningFormat, json_answer: bool) -> str:
    """The llguidance grammar (JSON text) of `grammar` applied after the thinking."""
    inner = _top_level(grammar)
    subgrammars = inner["grammars"]
    subgrammars[0]["name"] = ANSWER
    start = "think_end answer" if fmt.opened_by_prompt else \
        f"({LEADING_BLANKS} {_lark_string(START)} think_end)? answer"
    blanks = f"{LEADING_BLANKS} " if json_answer else ""
    lark = (f"start: {start}\n"
            f"think_end[lazy]: /(?s:.*)/ {_lark_string(END)}\n"
            f"answer: {blanks}@{ANSWER}\n")
    inner["grammars"] = [{"name": "start", "lark_grammar": lark}, *subgrammars]
    return json.dumps(inner)


def _top_level(grammar: str) -> dict:
    """llguidance takes a grammar as JSON (TopLevelGrammar) or as Lark text; the wrapper is
    JSON, holding a Lark grammar as one of its grammars."""
    try:
        return json.loads(grammar)
    except ValueError:
        return {"grammars": [{"lark_grammar": grammar}]}


def _lark_string(text: str) -> str:
    return json.dumps(text)


class ThinkingCloser:
    """A JSON answer's closer (JsonCloser or SchemaCloser, `inner`) fed only the answer's bytes;
    while the thinking is open, its closing begins with `</think>`. The manager reads and sets
    `forcing` and `plan` on it as on the closer itself."""

    def __init__(self, inner, fmt: ReasoningFormat):
        self.inner = inner
        self.stream = ReasoningStream(fmt)
        self.forcing = False
        self.plan: tuple[int, ...] | None = None
        self.tail = b""                    # what completes the thinking's last character

    def copy(self) -> "ThinkingCloser":
        twin = copy.copy(self)
        twin.inner = self.inner.copy()
        twin.stream = copy.copy(self.stream)
        return twin

    @property
    def thinking(self) -> bool:
        """Whether a closing must end the thinking first (an undecided start is thinking
        where the prompt opened it, the answer where the model would have to)."""
        state = self.stream.state
        return state == "reasoning" or (state == "start" and self.stream.fmt.opened_by_prompt)

    def feed(self, data: bytes) -> None:
        for b in data if self.thinking else b"":
            self.tail = self.tail[1:] if self.tail else utf8_tail(b) if b >= 0xC0 else b""
        # Latin-1 maps each byte to one character: the tags are ASCII, so the stream finds
        # them where it would in the text, and the answer's bytes come back unchanged.
        _, answer = self.stream.feed(data.decode("latin-1"))
        if answer:
            self.inner.feed(answer.encode("latin-1"))

    def closing(self) -> bytes | None:
        closing = self.inner.closing()
        return None if closing is None else self._before_answer() + closing

    def cost(self, tokens_of) -> int:
        return len(self._end_tokens(tokens_of)) + self.inner.cost(tokens_of)

    def closing_tokens(self, tokens_of) -> tuple[int, ...]:
        return self._end_tokens(tokens_of) + tuple(self.inner.closing_tokens(tokens_of))

    def growth(self, tokens_of) -> int:
        """The most one free token can add to what is written before the answer: a cut
        character's rest while thinking; before a model has opened its thinking, the tags."""
        if self.thinking:
            return THINKING_GROWTH
        if self.stream.state == "start":
            return len(tokens_of((START + END).encode()))
        return 0

    def _before_answer(self) -> bytes:
        """What must be written before the answer can begin: while thinking, the rest of a
        cut character and `</think>`; after part of an opening `<think>`, its rest too."""
        if self.thinking:
            return self.tail + END.encode()
        begun = self.stream.held.lstrip() if self.stream.state == "start" else ""
        return (START[len(begun):] + END).encode() if begun else b""

    def _end_tokens(self, tokens_of) -> tuple[int, ...]:
        before = self._before_answer()
        return tuple(tokens_of(before)) if before else ()
