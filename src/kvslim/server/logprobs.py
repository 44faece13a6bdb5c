"""Engine `TokenLogprob`s in the two OpenAI shapes: the legacy completions one (parallel lists)
and the chat one (a list of objects with bytes and top alternatives)."""
from __future__ import annotations

from kvslim.engine.sequence import TokenLogprob
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.server.responses import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs,
                                     TopLogprob)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # One token decoded alone; a piece of a multi-byte character comes out as U+FFFD.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob],
                        text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first token's text starts in the returned text."""
    result = CompletionLogprobs()
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        top = {token_text(tokenizer, t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)          # the chosen token is always listed
        result.tokens.append(text)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def echo_logprobs(tokenizer: Tokenizer, prompt_token_ids: list[int],
                  entries: list[TokenLogprob | None]) -> CompletionLogprobs:
    """The echoed prompt's part of the legacy shape: the first token has no logprob (null)."""
    first = token_text(tokenizer, prompt_token_ids[0])
    rest = completion_logprobs(tokenizer, entries[1:], len(first))
    return CompletionLogprobs(tokens=[first] + rest.tokens,
                              token_logprobs=[None] + rest.token_logprobs,
                              top_logprobs=[None] + rest.top_logprobs,
                              text_offset=[0] + rest.text_offset)


def join_logprobs(*parts: CompletionLogprobs) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for part in parts:
        result.tokens += part.tokens
        result.token_logprobs += part.token_logprobs
        result.top_logprobs += part.top_logprobs
        result.text_offset += part.text_offset
    return result


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for entry in entries:
        chosen = top(entry.token_id, entry.logprob)
        content.append(ChatTokenLogprob(**chosen.model_dump(),
                                        top_logprobs=[top(t, lp) for t, lp in entry.top]))
    return ChatLogprobs(content=content)
