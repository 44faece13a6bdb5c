"""Fifty varied JSON schemas, each with a chat prompt that asks for it: nested objects, enums,
arrays with bounds, required and optional fields, string patterns and lengths, number ranges,
nullable fields, constants. The conformance test (tests/server/test_structured_openai.py) and
`kvslim bench structured` both use them, so what is measured is what is tested."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str


def _obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


NAME = {"type": "string", "minLength": 1, "maxLength": 40}
SHORT = {"type": "string", "maxLength": 24}
YEAR = {"type": "integer", "minimum": 1000, "maximum": 2100}
SCORE = {"type": "number", "minimum": 0, "maximum": 1}
BOOL = {"type": "boolean"}
COLOR = {"enum": ["red", "green", "blue", "black", "white"]}
COUNTRY = {"type": "string", "pattern": "^[A-Z]{2}$"}
DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
EMAIL = {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"}
TAGS = {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}

SUBJECTS = ["Paris", "the Moon", "a bicycle", "Jane Austen", "the Linux kernel",
            "a cup of tea", "the Pacific Ocean", "a violin", "Mount Everest", "a lighthouse"]

TEMPLATES = [
    ("fact", _obj({"subject": NAME, "fact": {"type": "string", "maxLength": 80}})),
    ("rating", _obj({"subject": NAME, "score": {"type": "integer", "minimum": 1, "maximum": 5},
                     "reason": {"type": "string", "maxLength": 60}})),
    ("classify", _obj({"subject": NAME, "category": {"enum": ["place", "person", "object",
                                                              "nature", "software"]},
                       "is_alive": BOOL})),
    ("tags", _obj({"subject": NAME, "tags": TAGS, "color": COLOR})),
    ("nested", _obj({"subject": NAME, "location": _obj(
        {"country": COUNTRY, "city": {"anyOf": [SHORT, {"type": "null"}]}}),
        "known_since": YEAR})),
    ("record", _obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                     "subject": NAME, "created": DATE, "confidence": SCORE})),
    ("contact", _obj({"subject": NAME, "email": EMAIL, "phone": {"anyOf": [
        {"type": "string", "pattern": "^\\+[0-9]{6,12}$"}, {"type": "null"}]}},
        required=["subject", "email"])),
    ("list", _obj({"subject": NAME, "items": {"type": "array", "minItems": 2, "maxItems": 4,
                   "items": _obj({"name": SHORT, "count": {"type": "integer", "minimum": 0,
                                                            "maximum": 99}})}})),
    ("const", _obj({"version": {"const": 1}, "subject": NAME, "kind": {"enum": ["a", "b"]},
                    "notes": {"type": "array", "items": SHORT, "maxItems": 2}},
                   required=["version", "subject", "kind"])),
    ("matrix", _obj({"subject": NAME, "grid": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
                     "valid": BOOL})),
]


def schema_suite() -> list[SchemaCase]:
    """The fifty cases: each template for five subjects (the prompt names the subject)."""
    cases = []
    for t, (name, schema) in enumerate(TEMPLATES):
        for s in range(5):
            subject = SUBJECTS[(t + s) % len(SUBJECTS)]
            cases.append(SchemaCase(f"{name}-{s}", schema,
                                    f"Describe {subject} as a JSON object with the fields "
                                    f"{', '.join(schema['properties'])}. Answer with JSON only."))
    return cases
