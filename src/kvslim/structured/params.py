"""`StructuredOutputsParams`: what a request's output must match — a JSON schema, any JSON
object, a regex, one of a list of strings, or a grammar (Lark, or llama.cpp's GBNF) — under
vLLM's names (`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`).

`param` is the request field the constraint came from ("response_format", "tool_choice",
"structured_outputs", ...), so that a schema the grammar library refuses is a 400 naming the
field the user wrote. `reasoning` (a reasoning parser's convention) moves the constraint past the
thinking: it binds the answer after `</think>` (structured/after_reasoning.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvslim.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvslim.reasoning.parser import ReasoningFormat

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None      # a JSON schema (a dict or its text)
    json_object: bool = False                     # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                    # Lark, or GBNF (llama.cpp's grammars)
    param: str = field(default="structured_outputs", compare=False)
    # Set by a reasoning parser: the constraint binds the answer after the thinking.
    reasoning: ReasoningFormat | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}", self.param)
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}",
                                          self.param) from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be an object", self.param)
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                      self.param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string", self.param)

    @classmethod
    def from_dict(cls, fields: dict[str, Any], param: str = "structured_outputs"
                  ) -> "StructuredOutputsParams":
        unknown = sorted(set(fields) - set(KINDS))
        if unknown:
            raise InvalidRequestError(f"unknown structured output field(s) {', '.join(unknown)}; "
                                      f"expected one of {', '.join(KINDS)}", param)
        return cls(**fields, param=param)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The constraint as text: what the compiled-grammar cache is keyed by."""
        value = getattr(self, self.kind)
        after = "" if self.reasoning is None else f" after {self.reasoning}"
        return f"{self.kind}:{json.dumps(value, sort_keys=True)}{after}"
