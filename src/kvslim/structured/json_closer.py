"""`JsonCloser`: where a JSON answer stands, byte by byte, and the shortest text that would close
it — so that an answer about to reach `max_tokens` can be closed instead of cut.

A grammar keeps every token valid, but a model that repeats itself inside an object runs into
`max_tokens` with the object still open, and the answer does not parse. The manager feeds each
completion's bytes here; once the closing text no longer fits in what is left of the budget
with room for one more token's worth of growth, it forces the closing, token by token.

The scanner reads JSON the grammar has already checked, so it tracks only what closing needs:
the open containers, and whether the text stands in a string, a number, a literal, or between
tokens (expecting a key, a colon, a value, or a comma)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

# Modes between tokens, and inside one.
VALUE, KEY, COLON, AFTER, STRING, NUMBER, LITERAL = range(7)
DIGITS = frozenset(b"0123456789")
NUMBER_BYTES = DIGITS | frozenset(b"+-.eE")
WHITESPACE = frozenset(b" \t\r\n")
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
HEX = frozenset(b"0123456789abcdefABCDEF")
# What any other byte can add: a number's "e" needs a digit, "\\u" four hex digits.
OTHER_GROWTH = 4


@dataclass
class JsonCloser:
    stack: list[int] = field(default_factory=list)   # b"{" or b"[" of each open container
    mode: int = VALUE
    first: bool = True          # just after "{" or "[": the container may close at once
    is_key: bool = False        # the open string is an object's key
    escape: int = -1            # in a string: -1 none, 0 after "\", 1-4 after "\u" and 0-3 hex digits
    utf8_tail: bytes = b""      # in a string: what completes a character a token split
    number: bytes = b""         # the open number's last byte
    literal: bytes = b""        # what the open literal still needs
    broken: bool = False        # bytes no JSON grammar allows: closing is not attempted
    forcing: bool = False       # the manager has begun writing the closing (set by it)
    plan: tuple[int, ...] | None = None  # the closing's tokens left to write (set by it)

    def copy(self) -> "JsonCloser":
        twin = copy.copy(self)
        twin.stack = list(self.stack)
        return twin

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.broken:
                return
            self._byte(byte)

    def closing(self) -> bytes | None:
        """The shortest text that completes the JSON; None when it cannot be told."""
        if self.broken:
            return None
        if self.mode == VALUE and not self.stack and self.first:
            return b"{}"                                   # nothing written yet
        return self._finish_token() + b"".join(b"}" if c == ord("{") else b"]"
                                               for c in reversed(self.stack))

    def cost(self, tokens_of) -> int:
        """What writing the closing takes: at most one token a byte."""
        return len(self.closing())

    def closing_tokens(self, tokens_of) -> tuple[int, ...]:
        return tuple(tokens_of(self.closing()))

    def _finish_token(self) -> bytes:
        if self.mode == STRING:
            return self._pending() + (b'":null' if self.is_key else b'"')
        if self.mode == NUMBER:
            return b"0" if self.number in (b"-", b"+", b".", b"e", b"E") else b""
        if self.mode == LITERAL:
            return self.literal
        if self.mode == VALUE:
            return b"" if self.first else b"null"
        if self.mode == KEY:
            return b"" if self.first else b'"":null'
        if self.mode == COLON:
            return b":null"
        return b""                                         # AFTER

    def _pending(self) -> bytes:
        """What completes the character the open string stands in (an escape, or UTF-8 bytes
        a token split)."""
        if self.escape == 0:
            return b"n"
        if self.escape > 0:
            return b"0" * (5 - self.escape)
        return self.utf8_tail

    # ---- the scanner ---------------------------------------------------------------------
    def _byte(self, b: int) -> None:
        mode = self.mode
        if mode == STRING:
            self._string_byte(b)
        elif mode == NUMBER:
            self._number_byte(b)
        elif mode == LITERAL:
            if self.literal[:1] == bytes([b]):
                self.literal = self.literal[1:]
                if not self.literal:
                    self.mode = AFTER
            else:
                self.broken = True
        elif b in WHITESPACE:
            return
        elif mode == VALUE:
            self._value_byte(b)
        elif mode == KEY:
            if b == ord('"'):
                self.mode, self.is_key, self.escape, self.first = STRING, True, -1, False
                self._key_starts()
            elif b == ord("}") and self.first:
                self._close()
            else:
                self.broken = True
        elif mode == COLON:
            self._expect(b == ord(":"), VALUE)
        else:                                              # AFTER
            self._after_byte(b)

    def _value_byte(self, b: int) -> None:
        if b == ord("]") and self.first and self.stack and self.stack[-1] == ord("["):
            self._close()
            return
        self.first = False
        self._value_starts(b)
        if b in (ord("{"), ord("[")):
            self.stack.append(b)
            self.mode, self.first = (KEY if b == ord("{") else VALUE), True
        elif b == ord('"'):
            self.mode, self.is_key, self.escape = STRING, False, -1
        elif b in DIGITS or b == ord("-"):
            self.mode, self.number = NUMBER, bytes([b])
        elif b in LITERALS:
            self.mode, self.literal = LITERAL, LITERALS[b]
        else:
            self.broken = True

    def _number_byte(self, b: int) -> None:
        if b in NUMBER_BYTES:
            self.number = bytes([b])
        else:
            self.mode = AFTER
            self._byte(b)

    def _string_byte(self, b: int) -> None:
        if self.escape == 0:
            self.escape = 1 if b == ord("u") else -1
        elif self.escape > 0:
            if b not in HEX:
                self.broken = True
            self.escape = -1 if self.escape == 4 else self.escape + 1
        elif self.utf8_tail:
            self.utf8_tail = self.utf8_tail[1:]
        elif b == ord("\\"):
            self.escape = 0
        elif b == ord('"'):
            self.mode = COLON if self.is_key else AFTER
        elif b >= 0xC0:
            self.utf8_tail = utf8_tail(b)

    def _after_byte(self, b: int) -> None:
        if not self.stack:
            self.broken = True                             # text after the top-level value
        elif b == ord(","):
            self.mode, self.first = (KEY if self.stack[-1] == ord("{") else VALUE), False
        elif b == (ord("}") if self.stack[-1] == ord("{") else ord("]")):
            self._close()
        else:
            self.broken = True

    def _expect(self, ok: bool, mode: int) -> None:
        if ok:
            self.mode, self.first = mode, False
        else:
            self.broken = True

    def _close(self) -> None:
        self.stack.pop()
        self.mode, self.first = AFTER, False

    # What a closer that follows a schema hears of (schema_closer.py): nothing here.
    def _value_starts(self, b: int) -> None:
        pass

    def _key_starts(self) -> None:
        pass


def utf8_tail(lead: int) -> bytes:
    """Continuation bytes that complete a character begun with `lead` (the smallest that
    UTF-8 allows after it: E0 and F0 exclude overlong forms)."""
    length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    second = {0xE0: 0xA0, 0xF0: 0x90}.get(lead, 0x80)
    return bytes([second] + [0x80] * (length - 2))


# Where a token can start, by the innermost container: every mode the scanner has.
# Every place inside a literal too: a token may go on with any of them ("l," after "nul").
_LITERAL_PARTS = [word[:i] for word in (b"true", b"false", b"null") for i in range(1, len(word))]
OBJECT_STATES = [b"{", b'{"a":1', b'{"a":"x', b'{"x', b'{"a"', b'{"a":', b'{"a":1,',
                 b'{"a":-', b'{"a":1.', b'{"a":"\\', b'{"a":"\\u0', b'{"\\'] + [
                     b'{"a":' + part for part in _LITERAL_PARTS]
ARRAY_STATES = [b"[", b"[1", b"[1,", b'["x', b"[-", b"[1e", b'["\\', b'["\\u'] + [
    b"[" + part for part in _LITERAL_PARTS]
OUTER = {ord("{"): b'{"z":', ord("["): b"["}


def start_states(depth: int) -> list[bytes]:
    """Every start state with `depth` open containers (a token that closes k of them needs
    depth k + 1 to show what it does next)."""
    if depth == 0:
        return [b""]
    stacks = [b""]
    for _ in range(depth - 1):
        stacks = [s + OUTER[c] for s in stacks for c in OUTER]
    return [s + inner for s in stacks for inner in OBJECT_STATES + ARRAY_STATES]


def max_growth(token_bytes: list[bytes]) -> int:
    """The most one token can lengthen a closing text, over the vocabulary's tokens and every
    state JSON can stand in: the slack the manager keeps before it starts closing."""
    cache: dict[int, list[tuple[JsonCloser, int]]] = {}

    def starts(depth: int) -> list[tuple[JsonCloser, int]]:
        if depth not in cache:
            cache[depth] = []
            for text in start_states(depth):
                closer = JsonCloser()
                closer.feed(text)
                cache[depth].append((closer, len(closer.closing())))
        return cache[depth]

    # Only these bytes can lengthen a closing by more than OTHER_GROWTH: a quote opens a key
    # (`":null` to write), a bracket a container, a comma asks for another member.
    structural = frozenset(b'"{[,\\')
    worst = OTHER_GROWTH
    for data in token_bytes:
        if not any(b in structural for b in data):
            continue
        closes = min(data.count(b"}") + data.count(b"]"), 4)
        for depth in range(closes + 2):
            for start, before in starts(depth):
                closer = start.copy()
                closer.feed(data)
                after = closer.closing()
                if after is not None:
                    worst = max(worst, len(after) - before)
    return worst
