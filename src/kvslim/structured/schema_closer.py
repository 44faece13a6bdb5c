"""`SchemaCloser`: JsonCloser's scan, plus where the answer stands in its schema — so that the
closing text is one the schema accepts: the open string or number finished (a string padded to
its minLength, an enum value completed, a number brought into its range), then every open
container closed with the required members it still lacks written at their shortest.

`cost` is what writing the closing takes (the open token's end at one token a byte, each open
container's rest as the tokenizer cuts it), and `growth_bound` what the manager keeps in reserve
beside it: the most one token can add to that cost from the current state. Schema-aware closing
can grow by more than syntax alone (a comma in an array of objects asks for a whole shortest
item), so it is measured: every token that holds a structural byte or a number is fed to a copy,
and the worst is cached by the part of the state a token can reach (the innermost containers,
the open token); other tokens (letters in a string, a key, a literal) are bounded from the state
without feeding them."""
from __future__ import annotations

import copy
import math
import re
from decimal import Decimal
from dataclasses import dataclass

from kvslim.structured.json_closer import (AFTER, COLON, KEY, LITERAL, NUMBER, NUMBER_BYTES,
                                           STRING, VALUE, WHITESPACE, JsonCloser)
from kvslim.structured.schema_shape import (ArrayAlt, Node, NumberAlt, ObjectAlt, SchemaShape,
                                            StringAlt, TextsAlt)

CACHE_SIZE = 8192
STRUCTURAL = frozenset(b'"{}[],:\\')
NUMBER_TEXT = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
UTF8_GROWTH = 3                 # continuation bytes a token can leave owing (schema or not)


@dataclass
class ObjectFrame:
    alt: ObjectAlt
    next: int = 0               # the first declared property a key may still name
    member: Node | None = None  # the value node of the key written last

    def rest(self) -> bytes:
        return self.alt.fill(self.next) + b"}"

    def key(self) -> tuple:
        return (id(self.alt), self.next, id(self.member))


@dataclass
class ArrayFrame:
    alt: ArrayAlt
    count: int = 0              # items begun

    def rest(self, begun: int = 0) -> bytes:
        return (b"," + self.alt.item.min) * max(0, self.alt.min_items - self.count - begun) \
            + b"]"

    def key(self) -> tuple:
        return (id(self.alt), min(self.count, self.alt.min_items))


class SchemaCloser(JsonCloser):
    def __init__(self, shape: SchemaShape, depth: int = 4):
        super().__init__()
        self.shape = shape
        self.depth = depth          # containers one token can reach (it closes depth - 1)
        self.frames: list = []      # beside `stack`: where each open container is in the schema
        self.value = None           # the alternative the open string, number or literal follows
        self.text = bytearray()     # the open key, or the open value's bytes (enum, number)
        self.chars = 0              # characters of the open string
        self.lost = False           # the answer left what the shape knows: closed by syntax
        self.error: str | None = None   # why it was lost, if this closer failed (a bug)

    def copy(self) -> "SchemaCloser":
        twin = super().copy()
        twin.frames = [copy.copy(f) for f in self.frames]
        twin.text = bytearray(self.text)
        return twin

    # The closer runs on the step's mask thread: a state it misreads must cost this answer its
    # schema-aware closing, never the batch its step.
    def feed(self, data: bytes) -> None:
        try:
            super().feed(data)
        except Exception as e:                          # noqa: BLE001 - see above
            self._fail(e)

    def closing(self) -> bytes | None:
        parts = self._guarded_parts()
        return None if parts is None else b"".join(parts)

    def cost(self, tokens_of) -> int:
        """What writing the closing takes, counted so that one token changes it by what only
        the containers it reaches decide: the innermost part at one token a byte, then each
        open container's rest as `tokens_of` (the vocabulary's tokenizer) cuts it."""
        parts = self._guarded_parts()
        return len(parts[0]) + sum(len(tokens_of(p)) for p in parts[1:])

    def closing_tokens(self, tokens_of) -> tuple[int, ...]:
        """The closing's tokens, each part cut alone: no more than `cost` of them."""
        return tuple(t for part in self._guarded_parts() for t in tokens_of(part))

    def _guarded_parts(self) -> list[bytes] | None:
        try:
            return self._parts()
        except Exception as e:                          # noqa: BLE001 - see above
            self._fail(e)
            closing = super().closing()
            return None if closing is None else [closing]

    def _fail(self, e: Exception) -> None:
        self.lost, self.error = True, f"{type(e).__name__}: {e}"

    # ---- following the schema -------------------------------------------------------------
    def _expected(self) -> Node:
        if not self.frames:
            return self.shape.root
        frame = self.frames[-1]
        return frame.alt.item if isinstance(frame, ArrayFrame) else frame.member

    def _value_starts(self, b: int) -> None:
        if self.lost:
            return
        node = self._expected()
        alt = node.alt_for(b) if node is not None else None
        if alt is None:
            self.lost = True
            return
        if self.frames and isinstance(self.frames[-1], ArrayFrame):
            self.frames[-1].count += 1
        if isinstance(alt, ObjectAlt):
            self.frames.append(ObjectFrame(alt))
        elif isinstance(alt, ArrayAlt):
            self.frames.append(ArrayFrame(alt))
        else:
            self.value, self.text, self.chars = alt, bytearray([b]), 0

    def _key_starts(self) -> None:
        self.text = bytearray()

    def _string_byte(self, b: int) -> None:
        escape, utf8 = self.escape, self.utf8_tail
        super()._string_byte(b)
        if self.lost:
            return
        if self.mode == STRING:
            if self.is_key or isinstance(self.value, TextsAlt):
                self.text.append(b)
            # A character is counted where it ends: a plain byte, a lead byte's last
            # continuation, an escape's last byte.
            if self.escape == -1 and not self.utf8_tail and (escape != -1 or utf8 or b < 0x80):
                self.chars += 1
        elif self.is_key:
            self._key_ends()

    def _key_ends(self) -> None:
        frame, key = self.frames[-1], bytes(self.text)
        alt = frame.alt
        declared = [i for i in alt.keys_open(frame.next) if alt.names[i] == key]
        if declared:
            frame.next, frame.member = declared[0] + 1, alt.values[declared[0]]
        elif alt.additional is not None and alt.first_required(frame.next) == len(alt.names):
            frame.next, frame.member = len(alt.names), alt.additional
        else:
            self.lost = True

    def _number_byte(self, b: int) -> None:
        super()._number_byte(b)
        if self.mode == NUMBER and not self.lost:
            self.text.append(b)

    def _close(self) -> None:
        super()._close()
        if not self.lost:
            self.frames.pop()

    # ---- the closing text ------------------------------------------------------------------
    def _parts(self) -> list[bytes] | None:
        """The closing in parts: the open token's end (a key's, a string's, a number's,
        a literal's), then the innermost container's rest, then each outer one's."""
        if self.broken:
            return None
        if self.lost:
            closing = super().closing()
            return None if closing is None else [closing]
        if self.mode == VALUE and not self.stack and self.first:
            return [b"", self.shape.root.min]
        mode, frames = self.mode, self.frames
        if mode in (VALUE, KEY, COLON) or (mode == STRING and self.is_key):
            frame = frames[-1]
            inner = self._member_parts(frame) if isinstance(frame, ObjectFrame) \
                else [b"", self._item_text(frame)]
            frames = frames[:-1]
        else:
            tail = b"" if mode == AFTER else self._scalar_tail()
            inner = None if tail is None else [tail]
        return None if inner is None else inner + [f.rest() for f in reversed(frames)]

    def _item_text(self, frame: ArrayFrame) -> bytes:
        item = frame.alt.item.min
        if self.first:                                 # just after "["
            return b",".join([item] * frame.alt.min_items) + b"]"
        return item + frame.rest(begun=1)

    def _member_parts(self, frame: ObjectFrame) -> list[bytes] | None:
        """What ends the member being written (the open key's end, if any; the rest of the
        member and of its object)."""
        alt = frame.alt
        if self.mode == COLON or self.mode == VALUE:
            prefix = b":" if self.mode == COLON else b""
            return [b"", prefix + frame.member.min + frame.rest()]
        if self.mode == KEY:
            if self.first or alt.first_required(frame.next) < len(alt.names):
                return [b"", alt.fill(frame.next, comma=False) + b"}"]
            options = [alt.member(i) + alt.fill(i + 1) for i in range(frame.next,
                                                                       len(alt.names))]
            if alt.additional is not None:
                options.append(b'"' + alt.free_key(b"") + b'":' + alt.additional.min)
            return [b"", min(options, key=len) + b"}"] if options else None
        options = self._key_options(frame)
        return min(options, key=lambda o: len(o[0]) + len(o[1])) if options else None

    def _key_options(self, frame: ObjectFrame) -> list[list[bytes]]:
        """Each way the open key can end: its last bytes, then the rest of its member and
        object."""
        alt, key = frame.alt, bytes(self.text)
        options = [[alt.names[i][len(key):] + b'"', b":" + alt.values[i].min + alt.fill(i + 1)
                    + b"}"] for i in alt.keys_open(frame.next) if alt.names[i].startswith(key)]
        if alt.additional is not None and alt.first_required(frame.next) == len(alt.names):
            name = alt.free_key(key + self._pending())
            options.append([name[len(key):] + b'"', b":" + alt.additional.min + b"}"])
        return options

    def _scalar_tail(self) -> bytes | None:
        value = self.value
        if self.mode == LITERAL:
            return self.literal
        if isinstance(value, TextsAlt):
            options = [t[len(self.text):] for t in value.texts if t.startswith(self.text)]
            return min(options, key=len) if options else None
        if self.mode == NUMBER:
            return complete_number(bytes(self.text), value)
        pad = max(0, value.min_length - self.chars - (1 if self._pending() else 0))
        return self._pending() + b"a" * pad + b'"'

    # ---- what one token can add ------------------------------------------------------------
    def growth_bound(self, probes: list[bytes], tokens_of) -> int:
        """The most one token can add to the closing's cost from here: `probes` (the tokens
        with a structural byte or a number) fed to copies, the others bounded by
        `_plain_growth`."""
        cache = self.shape.growth_cache
        try:
            signature = self._signature()
            if signature not in cache:
                if len(cache) >= CACHE_SIZE:
                    cache.clear()
                cache[signature] = self._measure(probes, tokens_of)
            return cache[signature]
        except Exception as e:                          # noqa: BLE001 - as in feed
            self._fail(e)
            return 1 << 30                              # so: close now

    def _measure(self, probes: list[bytes], tokens_of) -> int:
        before = self.cost(tokens_of)
        worst = self._plain_growth(tokens_of)
        for data in probes:
            twin = self.copy()
            twin.feed(data)
            after = None if twin.lost or twin.closing() is None else twin.cost(tokens_of)
            if twin.error is not None:
                raise RuntimeError(twin.error)
            if after is not None:
                worst = max(worst, after - before)
        return worst

    def _plain_growth(self, tokens_of) -> int:
        """Tokens of letters and other text: a string's characters (an enum's can move to a
        longer value), a key's (to a longer member), a literal begun where a shorter value
        stood. All but the last change only the innermost part, counted a token a byte."""
        if self.mode == STRING and self.is_key:        # to another key: at most its cost
            costs = [len(tail) + len(tokens_of(rest))
                     for tail, rest in self._key_options(self.frames[-1])]
            tail, rest = self._parts()[:2]
            return UTF8_GROWTH + max(costs) - (len(tail) + len(tokens_of(rest)))
        if self.mode == STRING and isinstance(self.value, TextsAlt):
            options = [len(t) - len(self.text) for t in self.value.texts
                       if t.startswith(self.text)]
            return max(options) - min(options) if options else 0
        if self.mode == STRING:
            return UTF8_GROWTH
        if self.mode == VALUE:                           # a literal begun: fed, it is short
            node, before, worst = self._expected(), self.cost(tokens_of), 0
            words = [t for a in node.alts if isinstance(a, TextsAlt) for t in a.texts
                     if t[:1].isalpha()] if node is not None else []
            for word in words:
                for end in range(1, len(word) + 1):
                    twin = self.copy()
                    twin.feed(word[:end])
                    if not twin.lost and twin.closing() is not None:
                        worst = max(worst, twin.cost(tokens_of) - before)
            return worst
        return 0

    def _signature(self) -> tuple:
        """The part of the state a token's growth depends on: the open token, and the frames
        it can reach."""
        value = self.value
        if self.mode == STRING and self.is_key:
            alt = self.frames[-1].alt
            matches = any(n.startswith(self.text) for n in alt.names)
            token = bytes(self.text) if matches else b"\0free"
        elif self.mode == STRING and isinstance(value, StringAlt):
            token = min(self.chars, value.min_length)
        elif self.mode in (STRING, NUMBER) and not (isinstance(value, NumberAlt)
                                                    and value.low is None
                                                    and value.high is None):
            token = bytes(self.text)
        else:
            token = None
        return (self.mode, self.first, self.is_key, self.escape, self.utf8_tail, self.number,
                self.literal, id(value), token, len(self.frames) > self.depth,
                tuple(f.key() for f in self.frames[-self.depth:]))


def probes_of(vocabulary: list[bytes]) -> list[bytes]:
    """The tokens growth_bound feeds: each with a structural byte, or made of a number's bytes
    (and blanks); the others are letters and text, bounded without feeding them."""
    numeric = NUMBER_BYTES | WHITESPACE
    return list(dict.fromkeys(
        data for data in vocabulary if any(b in STRUCTURAL for b in data)
        or (all(b in numeric for b in data) and any(b in NUMBER_BYTES for b in data))))


def complete_number(text: bytes, alt: NumberAlt) -> bytes | None:
    """The shortest bytes after `text` (a number begun) that end it in `alt`'s range; None
    when there are none this knows of."""
    s = text.decode()
    if alt.low is None and alt.high is None:            # any number: the syntax's closing
        return b"0" if s[-1] in "-+.eE" else b""
    if len(s) > 40:
        return None                                     # longer than any range allows
    if "." in s and not re.search(r"[eE]", s):
        return _fraction_tail(s, alt)
    if not re.fullmatch(r"-?[0-9]*", s):                # an exponent begun
        tail = "0" if s[-1] in "eE+-" else ""
        if not NUMBER_TEXT.fullmatch(s + tail):
            return None                                 # no number: the grammar forbids it
        return tail.encode() if alt.fits(float(s + tail)) else None
    sign, digits = (-1 if s.startswith("-") else 1), s.lstrip("-")
    if digits.startswith("0") and len(digits) > 1:
        return None
    # No digit may follow a leading zero.
    for more in range(0 if digits else 1, 1 if digits.startswith("0") else 20):
        if digits:
            low = int(digits) * 10 ** more
            high = low + 10 ** more - 1
        else:
            low, high = (10 ** (more - 1) if more > 1 else 0), 10 ** more - 1
        magnitude = max(low, _least_magnitude(alt, sign))
        if magnitude <= high and alt.fits(sign * magnitude):
            return str(magnitude)[len(digits):].encode()
    if alt.integer or not digits:
        return None
    tail = _fraction_tail(s + ".", alt)
    return b"." + tail if tail is not None else None


def _fraction_tail(s: str, alt: NumberAlt) -> bytes | None:
    """The fewest digits after `s` (a number up to and into its fraction) that land it in the
    range: the least that reach the range's near end, checked against the far one."""
    if not re.fullmatch(r"-?(0|[1-9][0-9]*)\.[0-9]*", s):
        return None                                     # no number: the grammar forbids it
    sign = -1 if s.startswith("-") else 1
    places = len(s.split(".")[1])
    base = Decimal(s + "0" if s.endswith(".") else s)
    near, is_open = (alt.low, alt.low_open) if sign > 0 else (alt.high, alt.high_open)
    for more in range(0 if places else 1, 12):
        step = Decimal(10) ** -(places + more)
        least = 0
        if near is not None:
            gap = (Decimal(str(near)) - base) * sign / step
            least = max(0, math.floor(gap) + 1 if is_open else math.ceil(gap))
        if least < 10 ** more and alt.fits(float(base + sign * least * step)):
            return str(least).zfill(more).encode() if more else b""
    return None


def _least_magnitude(alt: NumberAlt, sign: int) -> int:
    """The least magnitude whose value (of `sign`) is not below the range's near end."""
    bound, is_open = (alt.low, alt.low_open) if sign > 0 else (
        None if alt.high is None else -alt.high, alt.high_open)
    if bound is None:
        return 0
    return max(0, math.floor(bound) + 1 if is_open else math.ceil(bound))
