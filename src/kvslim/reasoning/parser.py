"""Reasoning apart from the answer: models that think in `<think>...</think>` before they
answer (DeepSeek-R1 and its distills, Qwen3) get their thinking returned as
`reasoning_content`, the rest as `content` (vLLM's and SGLang's --reasoning-parser).

Two conventions, by who opens the block (`--reasoning-parser` names them after the families
that use them, in tools/registry.py):
  * PROMPT_OPENS (DeepSeek-R1): the chat template opens `<think>` in the prompt, so the answer
    starts inside the thinking: everything up to `</think>` is reasoning (a leading `<think>`
    the model writes itself is dropped); without `</think>` (the budget ran out) all of it is.
  * MODEL_OPENS (Qwen3): the model opens the block itself: reasoning only when the answer
    starts with `<think>` (after blanks), up to `</think>` or the end; any other answer is all
    content (thinking switched off).
`split` reads a whole answer; `ReasoningStream` the same answer in pieces, with the same
result however the text is cut."""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    opened_by_prompt: bool           # the answer starts inside <think>

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content); None for an empty part."""
        stream = ReasoningStream(self)
        parts = [stream.feed(text), stream.finish()]
        reasoning = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        return reasoning or None, content or None


PROMPT_OPENS = ReasoningFormat(opened_by_prompt=True)
MODEL_OPENS = ReasoningFormat(opened_by_prompt=False)


class ReasoningStream:
    """Splits an answer fed in pieces: feed(delta) -> (reasoning, content) ready so far; text
    that may be the start of a tag is held back until the next piece (or finish) decides."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        # "start": nothing decided yet; "reasoning"; "content"
        self.state = "start"
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.held += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                if not self._decide_start():
                    return reasoning, content
            elif self.state == "reasoning":
                at = self.held.find(END)
                if at < 0:
                    keep = partial_suffix(self.held, END)
                    reasoning += self.held[:len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    return reasoning, content
                reasoning += self.held[:at]
                self.held = self.held[at + len(END):]
                self.state = "content"
            else:
                content += self.held
                self.held = ""
                return reasoning, content

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        """feed(delta), and finish() too when the answer ended with it."""
        reasoning, content = self.feed(delta)
        if finished:
            rest = self.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back, once the answer has ended."""
        held, self.held = self.held, ""
        if self.state == "start":
            return (held, "") if self.fmt.opened_by_prompt else ("", held)
        return (held, "") if self.state == "reasoning" else ("", held)

    def _decide_start(self) -> bool:
        """At the answer's start: an opening <think> (after blanks) is dropped and thinking
        begins; anything else decides by the format. False: not enough text yet."""
        text = self.held.lstrip()
        if text.startswith(START):
            self.held, self.state = text[len(START):], "reasoning"
            return True
        if START.startswith(text):               # blanks, or part of "<think>": wait
            return False
        self.state = "reasoning" if self.fmt.opened_by_prompt else "content"
        return True


def partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (held back by a stream parser
    until the next piece decides; tools/format.py's parsers too)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
