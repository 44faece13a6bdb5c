"""`SchemaShape`: what closing a JSON answer needs to know of its schema — at each place, the
kinds of value allowed and the shortest text of each — read from the schema once per grammar.

A value's node is a small set of alternatives told apart by the value's first byte (`{`, `[`,
`"`, a digit or `-`, a letter of true/false/null), as llguidance's grammar tells them apart:
an object (its properties in the schema's order, which required, what else is allowed), an array
(its item and minItems), a string (minLength), a number (its range), or a fixed set of JSON texts
(enum, const, booleans, null). A schema that needs more than this to close — patterns, formats,
allOf, two objects in one anyOf, a required property that is not declared — raises `Unsupported`,
and its answers are closed by syntax alone (JsonCloser)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

# Keywords that change nothing a closing writes (llguidance enforces the limits among them).
IGNORED = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                     "deprecated", "readOnly", "writeOnly", "maxLength", "maxItems",
                     "uniqueItems", "$defs", "definitions", "x-guidance", "strict"})
OBJECT_KEYS = {"properties", "required", "additionalProperties"}
ARRAY_KEYS = {"items", "minItems"}
STRING_KEYS = {"minLength"}
NUMBER_KEYS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
TYPE_KEYS = {"object": OBJECT_KEYS, "array": ARRAY_KEYS, "string": STRING_KEYS,
             "number": NUMBER_KEYS, "integer": NUMBER_KEYS, "boolean": set(), "null": set()}


class Unsupported(ValueError):
    """The schema uses something closing cannot follow."""


def dumps(value) -> bytes:
    """JSON text as the grammar writes it: compact, UTF-8 unescaped."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(eq=False)
class Node:
    """The values allowed at one place: alternatives with distinct first bytes."""
    alts: list = field(default_factory=list)
    _min: bytes | None = None
    _busy: bool = False

    def alt_for(self, first: int):
        return next((a for a in self.alts if first in a.starts), None)

    @property
    def min(self) -> bytes:
        """The shortest JSON text of a value here."""
        if self._min is None:
            if self._busy:
                raise Unsupported("a schema whose shortest value contains itself")
            self._busy = True
            self._min = min((a.min for a in self.alts), key=len)
            self._busy = False
        return self._min


@dataclass(eq=False)
class ObjectAlt:
    names: list[bytes]              # property names, JSON-escaped, in the schema's order
    values: list[Node]
    required: list[bool]
    additional: Node | None         # None: no other property allowed
    starts: bytes = b"{"

    @property
    def min(self) -> bytes:
        return b"{" + self.fill(0, comma=False) + b"}"

    def member(self, i: int) -> bytes:
        return b'"' + self.names[i] + b'":' + self.values[i].min

    def fill(self, start: int, comma: bool = True) -> bytes:
        """The required members from property `start` on, each after a comma (or not the
        first, when `comma` is False: nothing was written in the object yet)."""
        parts = [self.member(i) for i in range(start, len(self.names)) if self.required[i]]
        text = b",".join(parts)
        return (b"," + text if comma else text) if parts else b""

    def free_key(self, key: bytes) -> bytes:
        """`key` (the bytes of another property's name), made no declared name: the grammar
        takes a declared name for that property alone."""
        while key in self.names:
            key += b"_"
        return key

    def first_required(self, start: int) -> int:
        return next((i for i in range(start, len(self.names)) if self.required[i]),
                    len(self.names))

    def keys_open(self, start: int) -> list[int]:
        """The declared properties a key may name now: up to the next required one (the grammar
        keeps the schema's order)."""
        return list(range(start, min(self.first_required(start) + 1, len(self.names))))


@dataclass(eq=False)
class ArrayAlt:
    item: Node
    min_items: int
    starts: bytes = b"["

    @property
    def min(self) -> bytes:
        return b"[" + b",".join([self.item.min] * self.min_items) + b"]"


@dataclass(eq=False)
class StringAlt:
    min_length: int
    starts: bytes = b'"'

    @property
    def min(self) -> bytes:
        return b'"' + b"a" * self.min_length + b'"'


@dataclass(eq=False)
class NumberAlt:
    integer: bool
    low: float | None               # the range's ends (None: unbounded)...
    high: float | None
    low_open: bool = False          # ...each excluded when open (exclusiveMinimum/Maximum)
    high_open: bool = False
    starts: bytes = b"-0123456789"

    def fits(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open
                                                            and value == self.high))

    @property
    def min(self) -> bytes:
        candidates = [0]
        if self.low is not None:
            candidates += [math.ceil(self.low), math.floor(self.low) + 1]
        if self.high is not None:
            candidates += [math.floor(self.high), math.ceil(self.high) - 1]
        if not self.integer:
            candidates += [b for b in (self.low, self.high) if b is not None]
            if self.low is not None and self.high is not None:
                candidates.append((self.low + self.high) / 2)
        fitting = sorted((c for c in candidates if self.fits(c)), key=lambda c: (
            len(dumps(c)), abs(c)))                      # as complete_number would choose
        if not fitting:
            raise Unsupported("a number range without a short value")
        return dumps(fitting[0])


@dataclass(eq=False)
class TextsAlt:
    """A value that is one of fixed JSON texts (enum, const, booleans, null)."""
    texts: tuple[bytes, ...]
    starts: bytes = b""

    def __post_init__(self):
        self.starts = bytes(sorted({t[0] for t in self.texts}))

    @property
    def min(self) -> bytes:
        return min(self.texts, key=len)


class SchemaShape:
    """The root node of a schema, and the nodes of its `$ref`s (each built once)."""

    def __init__(self, schema: dict | bool):
        self.schema = schema
        self._refs: dict[str, Node] = {}
        self.growth_cache: dict[tuple, int] = {}         # SchemaCloser's, shared by answers
        self.root = self.node(schema)
        for node in self._nodes():
            node.min                                     # raises for a self-containing one

    def _nodes(self) -> list[Node]:
        """Every node, each once."""
        seen, todo = {}, [self.root]
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            for alt in node.alts:
                if isinstance(alt, ObjectAlt):
                    todo += alt.values + ([alt.additional] if alt.additional else [])
                elif isinstance(alt, ArrayAlt):
                    todo.append(alt.item)
        return list(seen.values())

    def node(self, schema) -> Node:
        if schema is True or schema == {}:
            return self.any()
        if not isinstance(schema, dict):
            raise Unsupported("a schema that is not an object")
        _check_whitespace(schema.get("x-guidance"))
        if "$ref" in schema:
            if set(schema) - IGNORED - {"$ref"}:
                raise Unsupported("$ref beside other keywords")
            return self._ref(schema["$ref"])
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if any(isinstance(v, (dict, list)) for v in values) or not values:
                raise Unsupported("an enum of objects or arrays")
            return self._distinct([TextsAlt(tuple(dumps(v) for v in values))])
        for union in ("anyOf", "oneOf"):
            if union in schema:
                if set(schema) - IGNORED - {union}:
                    raise Unsupported(f"{union} beside other keywords")
                return self._distinct([a for s in schema[union] for a in self.node(s).alts])
        types = schema.get("type")
        if types is None:
            if set(schema) - IGNORED:
                raise Unsupported("constraints without a type")
            return self.any()
        types = [types] if isinstance(types, str) else list(types)
        allowed = set().union(*(TYPE_KEYS.get(t, set()) for t in types)) | IGNORED | {"type"}
        extra = set(schema) - allowed
        if extra or any(t not in TYPE_KEYS for t in types):
            raise Unsupported(f"keyword(s) {', '.join(sorted(extra)) or types}")
        return self._distinct([self._alt(t, schema) for t in types])

    def any(self) -> Node:
        """Any JSON value: closed as JsonCloser closes one."""
        node = Node()
        node.alts = [ObjectAlt([], [], [], node), ArrayAlt(node, 0), StringAlt(0),
                     NumberAlt(False, None, None), TextsAlt((b"true", b"false", b"null"))]
        node._min = b"null"
        return node

    def _alt(self, kind: str, schema: dict):
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            items = schema.get("items", True)
            if isinstance(items, list):
                raise Unsupported("items as a list")
            return ArrayAlt(self.node(items), int(schema.get("minItems", 0)))
        if kind == "string":
            return StringAlt(int(schema.get("minLength", 0)))
        if kind in ("number", "integer"):
            return _number(kind == "integer", schema)
        return TextsAlt((b"true", b"false") if kind == "boolean" else (b"null",))

    def _object(self, schema: dict) -> ObjectAlt:
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        if required - set(properties):
            raise Unsupported("a required property that is not declared")
        extra = schema.get("additionalProperties", True)
        return ObjectAlt([dumps(name)[1:-1] for name in properties],
                         [self.node(s) for s in properties.values()],
                         [name in required for name in properties],
                         None if extra is False else self.node(extra))

    def _ref(self, ref: str) -> Node:
        if ref not in self._refs:
            match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
            if match is None or not isinstance(self.schema, dict) \
                    or match[2] not in self.schema.get(match[1], {}):
                raise Unsupported(f"the reference {ref}")
            self._refs[ref] = node = Node()              # before building: it may recurse
            node.alts = self.node(self.schema[match[1]][match[2]]).alts
        return self._refs[ref]

    @staticmethod
    def _distinct(alts: list) -> Node:
        """One node from alternatives; texts merge, and no two may start with the same byte
        (then the first byte would not tell which one a value follows)."""
        texts = [t for a in alts if isinstance(a, TextsAlt) for t in a.texts]
        alts = [a for a in alts if not isinstance(a, TextsAlt)]
        if texts:
            alts.append(TextsAlt(tuple(dict.fromkeys(texts))))
        starts = [b for a in alts for b in a.starts]
        if len(starts) != len(set(starts)):
            raise Unsupported("alternatives that start alike")
        return Node(alts)


def _number(integer: bool, schema: dict) -> NumberAlt:
    low, high = schema.get("minimum"), schema.get("maximum")
    low_open = high_open = False
    for key, is_low in (("exclusiveMinimum", True), ("exclusiveMaximum", False)):
        value = schema.get(key)
        if isinstance(value, bool) or value is None:
            if is_low:
                low_open = bool(value)
            else:
                high_open = bool(value)
        elif is_low and (low is None or value >= low):
            low, low_open = value, True
        elif not is_low and (high is None or value <= high):
            high, high_open = value, True
    return NumberAlt(integer, low, high, low_open, high_open)


def _check_whitespace(options) -> None:
    """Closing writes compact JSON: a schema's own whitespace rule must allow none."""
    if options is None:
        return
    try:
        blank = re.fullmatch(options["whitespace_pattern"], "") is not None
    except (KeyError, TypeError, re.error):
        blank = False
    if not blank or set(options) != {"whitespace_pattern"}:
        raise Unsupported("x-guidance options other than a whitespace pattern that allows none")
