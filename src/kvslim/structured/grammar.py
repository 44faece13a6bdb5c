"""`GrammarCompiler`: a request's constraint turned into a grammar llguidance can run, checked
against the model's vocabulary once and cached by the constraint's text.

llguidance was chosen by measurement (benchmarks/grammar_backends.py, docs/structured_outputs.md):
no compile step to wait for, masks for a batch of 32 in about a millisecond on 49k and 262k
vocabularies, Lark and GBNF grammars besides JSON schema and regex, masks for draft tokens, and
no dependencies of its own."""
from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from kvslim.errors import InvalidRequestError
from kvslim.structured.json_closer import JsonCloser, max_growth
from kvslim.structured.params import StructuredOutputsParams
from kvslim.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvslim.structured.schema_shape import SchemaShape

CACHE_SIZE = 256
# JSON's whitespace between tokens: at most one line break, then up to 24 blanks (compact JSON,
# ", " and ": ", and pretty-printing to a depth of 6 at indent 4). Unbounded, a model can emit
# blanks until max_tokens (small ones do) and the answer never parses. A schema's own
# "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_pattern": r"(\r?\n)?[\x20\x09]{0,24}"}


def _llguidance():
    try:
        import llguidance
    except ImportError:                                     # pragma: no cover - a dependency
        raise InvalidRequestError("structured outputs need the llguidance package "
                                  "(pip install llguidance)") from None
    return llguidance


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer_source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._shapes: dict[str, SchemaShape | None] = {}  # grammar -> what closing needs of it

    @property
    def ll_tokenizer(self):
        """llguidance's view of the vocabulary: built on first use (seconds for 262k tokens),
        then shared by every matcher."""
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                self._ll_tokenizer = llg.LLTokenizer(
                    self._tokenizer_source.tok.to_str(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def token_bytes(self, token_ids: list[int]) -> bytes:
        return self.ll_tokenizer.decode_bytes(list(token_ids))

    def vocab_bytes(self) -> list[bytes]:
        tok = self.ll_tokenizer
        return [tok.decode_bytes([i]) for i in range(tok.vocab_size)]

    @functools.cached_property
    def json_growth(self) -> int:
        """The most one token can lengthen a JSON closing text (JsonCloser), over this
        vocabulary: computed once (50 ms for 49k tokens)."""
        return max_growth(self.vocab_bytes())

    @functools.cached_property
    def closing_probes(self) -> list[bytes]:
        """The tokens a SchemaCloser feeds to measure what one token can add to its closing
        (595 of SmolLM2's 49,152)."""
        from kvslim.structured.schema_closer import probes_of   # schema answers only
        return probes_of(self.vocab_bytes())

    @functools.cached_property
    def closing_depth(self) -> int:
        """How many open containers one token can reach: those it closes, and one more."""
        return 1 + max([d.count(b"}") + d.count(b"]") for d in self.closing_probes] + [0])

    def shape(self, grammar: str) -> SchemaShape | None:
        """What closing needs of a JSON schema's grammar; None where the syntax alone closes
        its answers (json_object, and schemas SchemaShape cannot follow)."""
        return self._shapes.get(grammar)

    def closer(self, shape: SchemaShape | None) -> JsonCloser:
        if shape is None:
            return JsonCloser()
        from kvslim.structured.schema_closer import SchemaCloser      # schema answers only
        return SchemaCloser(shape, self.closing_depth)

    @functools.lru_cache(maxsize=1024)
    def closing_tokens(self, closing: bytes) -> tuple[int, ...]:
        return tuple(self.ll_tokenizer.tokenize_bytes(closing))

    def compile(self, params: StructuredOutputsParams, max_tokens: int | None = None) -> str:
        """The grammar for `params`; an InvalidRequestError naming `params.param` when the
        library cannot build it (an invalid schema, a grammar feature it lacks), or naming
        max_tokens when the shortest JSON the schema allows needs more tokens than that."""
        grammar = self._compiled(params)
        shape = self._shapes.get(grammar)
        if max_tokens is not None and params.kind in ("json", "json_object"):
            shortest = shape.root.min if shape is not None else b"{}" \
                if params.kind == "json_object" else None
            if shortest is not None and self._shortest_cost(params, shortest) > max_tokens:
                raise InvalidRequestError(
                    f"max_tokens ({max_tokens}) is too small for {_what(params)}: its shortest "
                    f"JSON, {shortest.decode()}, takes {len(self.closing_tokens(shortest))} "
                    f"tokens{_after_thinking(params, self.closing_tokens)}", "max_tokens")
        return grammar

    def _shortest_cost(self, params: StructuredOutputsParams, shortest: bytes) -> int:
        """The tokens of the shortest answer, and of the `</think>` before it where the prompt
        opens the thinking."""
        return len(self.closing_tokens(shortest)) + _thinking_end(params, self.closing_tokens)

    def _compiled(self, params: StructuredOutputsParams) -> str:
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._grammar_text(params)
        if params.reasoning is not None:
            from kvslim.structured.after_reasoning import wrap_after_reasoning
            grammar = wrap_after_reasoning(grammar, params.reasoning,
                                           params.kind in ("json", "json_object"))
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                           self.ll_tokenizer)
        if is_error:
            raise InvalidRequestError(f"{_what(params)} cannot be compiled: "
                                      f"{_one_line(messages[0])}", params.param)
        shape = _shape(params)
        with self._lock:
            self._cache[key] = grammar
            self._shapes[grammar] = shape
            while len(self._cache) > CACHE_SIZE:
                self._shapes.pop(self._cache.popitem(last=False)[1], None)
        return grammar

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        llg = _llguidance()
        try:
            if params.kind == "json":
                return llg.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
            if params.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                              defaults=JSON_OPTIONS)
            if params.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(params.regex)
            if params.kind == "choice":
                return llg.grammar_from("choice", json.dumps(params.choice))
            return llg.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise InvalidRequestError(f"{_what(params)} cannot be compiled: {_one_line(str(e))}",
                                      params.param) from None

    def matcher(self, grammar: str):
        llg = _llguidance()
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: "
                                      f"{_one_line(matcher.get_error())}")
        return matcher


def _shape(params: StructuredOutputsParams) -> SchemaShape | None:
    if params.kind != "json":
        return None
    # Loaded with the first schema, not with `import kvslim` (tests/test_lab_boundary.py).
    from kvslim.structured.schema_shape import SchemaShape, Unsupported
    try:
        return SchemaShape(params.json)
    except (Unsupported, RecursionError, TypeError, ValueError):
        return None                             # closed by syntax alone


def _what(params: StructuredOutputsParams) -> str:
    return {"json": "the JSON schema", "json_object": "the JSON grammar", "regex": "the regex",
            "choice": "the choice list", "grammar": "the grammar"}[params.kind]


def _thinking_end(params: StructuredOutputsParams, tokens_of) -> int:
    """The tokens of the `</think>` an answer needs first: where the prompt opens the thinking
    (a model that opens it itself may answer without it)."""
    if params.reasoning is None or not params.reasoning.opened_by_prompt:
        return 0
    from kvslim.reasoning.parser import END
    return len(tokens_of(END.encode()))


def _after_thinking(params: StructuredOutputsParams, tokens_of) -> str:
    n = _thinking_end(params, tokens_of)
    return f", after the {n} tokens that end the thinking" if n else ""


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]
