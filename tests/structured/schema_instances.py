"""Schemas that closing follows (strings, numbers in ranges, enums, nullable values, arrays of
objects with required string fields, nested arrays, a recursive $ref), and a hypothesis strategy
for their valid instances, properties in the schema's order as llguidance writes them."""
from __future__ import annotations

from hypothesis import strategies as st

SIZE = {"enum": ["S", "M", "XL"]}
ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "minLength": 2}, "qty": {"type": "integer", "minimum": 1,
                                                       "maximum": 999},
    "note": {"type": "string"}, "size": SIZE}, "required": ["sku", "qty"],
    "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1000}, "items": {"type": "array", "items": ITEM,
                                                          "minItems": 1},
    "rush": {"type": "boolean"}, "price": {"type": "number", "minimum": 0.5,
                                           "maximum": 99.5}},
    "required": ["id", "items", "price"]}
GRID = {"type": "object", "properties": {
    "grid": {"type": "array", "minItems": 1, "items": {
        "type": "array", "minItems": 2, "items": {"type": "integer", "minimum": -9,
                                                  "maximum": -2}}},
    "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    "kind": {"const": "grid"}}, "required": ["grid", "label", "kind"],
    "additionalProperties": False}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["name"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
SCHEMAS = {"order": ORDER, "grid": GRID, "tree": TREE}

# Characters a grammar lets a model write: no surrogates, no raw DEL (llguidance refuses it;
# JSON escapes the other control characters).
CHARS = st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\x7f")
TEXT = st.text(CHARS, max_size=5)
ANY = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | TEXT,
                   lambda inner: st.lists(inner, max_size=2)
                   | st.dictionaries(TEXT, inner, max_size=2), max_leaves=4)


def instances(schema: dict, root: dict | None = None, depth: int = 0) -> st.SearchStrategy:
    """Valid instances of the schemas above (not of every schema); a recursive one's arrays
    are empty three references deep."""
    root = root or schema
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: instances(root["$defs"][name], root, depth + 1))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    if "anyOf" in schema:
        return st.one_of([instances(s, root, depth) for s in schema["anyOf"]])
    kind = schema["type"]
    if kind == "object":
        return _objects(schema, root, depth)
    if kind == "array":
        least = schema.get("minItems", 0)
        return st.lists(instances(schema["items"], root, depth), min_size=least,
                        max_size=max(least, 3 if depth < 3 else 0))
    if kind == "string":
        return st.text(CHARS, min_size=schema.get("minLength", 0),
                       max_size=schema.get("maxLength", 8))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"))
    return st.booleans() if kind == "boolean" else st.none()


def _objects(schema: dict, root: dict, depth: int) -> st.SearchStrategy:
    names = list(schema["properties"])
    required = set(schema.get("required", []))

    @st.composite
    def build(draw):
        obj = {}
        for name in names:
            if name in required or draw(st.booleans()):
                obj[name] = draw(instances(schema["properties"][name], root, depth))
        if schema.get("additionalProperties", True) is not False:
            for key, value in draw(st.dictionaries(TEXT, ANY, max_size=2)).items():
                if key not in schema["properties"]:
                    obj[key] = value
        return obj
    return build()
