"""Incremental detokenization with stop strings.

Text is only released once it is complete: a byte-level BPE token can end in the middle of a
multi-byte character, which decodes to U+FFFD until the next token completes it. Stop strings
are searched in the text as it grows; the output is cut exactly before the stop string. While
streaming, the last len(longest stop) - 1 characters are held back, since they may turn out to
be the start of a stop string."""
from __future__ import annotations

from kvslim.tokenizer.tokenizer import Tokenizer

# Tokens of the prompt decoded together with the first output tokens, so that tokenizers whose
# decoding depends on the previous token (leading spaces) produce the right first characters.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.num_added = 0                 # output tokens decoded so far
        self.stopped_by: str | None = None
        self._stop_at = -1

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> None:
        """Decode newly generated tokens; sets `stopped_by` when a stop string appears (only
        searched when `check_stop`, i.e. once min_tokens is reached)."""
        for token_id in token_ids:
            if self.stopped_by is not None:
                return
            self.token_ids.append(token_id)
            self.num_added += 1
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._append(full[len(prefix):], check_stop)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    def skip_token(self) -> None:
        """Count a token without adding its text: the stop token (EOS, or one of
        stop_token_ids) that ended the answer is not part of it (as in vLLM, unless
        include_stop_str_in_output)."""
        self.num_added += 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, new_text: str, check_stop: bool) -> None:
        start = max(0, len(self.text) - self.holdback)
        self.text += new_text
        for stop in (self.stop if check_stop else ()):
            at = self.text.find(stop, start)
            if at != -1 and (self.stopped_by is None or at < self._stop_at):
                self.stopped_by, self._stop_at = stop, at
        if self.stopped_by is not None:
            end = self._stop_at + (len(self.stopped_by) if self.include_stop else 0)
            self.text = self.text[:end]

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, minus what could start a stop string."""
        upto = len(self.text) if finished or self.stopped_by else len(self.text) - self.holdback
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
