"""The OpenAI wire format's request bodies, validated with pydantic (responses.py: the answers).

Types are strict (`"0.5"` is not a number), so a wrong type is a 400 rather than a silent
coercion. Range checks (max_tokens >= 1, 0 < top_p <= 1, ...) are left to `SamplingParams`, the
one place that knows them; `to_sampling_params` builds it and raises `InvalidRequestError` naming
the field."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      WithJsonSchema, field_validator, model_validator)

from kvslim.engine.sampling_params import (MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                                           MIN_REPETITION_PENALTY, SEED_MAX, SEED_MIN,
                                           SamplingParams)
from kvslim.errors import InvalidRequestError
from kvslim.structured.params import StructuredOutputsParams
from kvslim.tools.chat import ToolRequest
from kvslim.tools.spec import TOOL_CHOICE_SCHEMA, TOOL_SCHEMA



def _integral(value):
    """JSON Schema counts 2.0 as an integer; strict pydantic would not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]


def _int(**limits):
    """An integer field's type with its limits inside (so that they reach the JSON schema of
    an Optional field too)."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]   # in this order


NonEmpty = Annotated[str, Field(min_length=1)]
# Below the model's vocabulary size too (the tokenizer's, for text): the published schema
# says so (server/openapi.py).
TokenId = _int(ge=0, json_schema_extra={"x-token-id": "model"})
TokenIds = list[TokenId]
# Checked by tools/spec.py (errors naming tools or tool_choice); published as what it accepts.
Tools = Annotated[Optional[list[dict[str, Any]]],
                  WithJsonSchema({"anyOf": [{"type": "array", "items": TOOL_SCHEMA},
                                            {"type": "null"}]})]
ToolChoice = Annotated[Union[Literal["none", "auto", "required"], dict[str, Any], None],
                       WithJsonSchema(TOOL_CHOICE_SCHEMA)]
TOKEN_ID_KEYS = {"propertyNames": {"pattern": "^[0-9]+$", "x-token-id-key": "model"}}
# tool_choice "required" or a named function needs tools.
TOOLS_NEEDED = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
    "anyOf": [{"const": "required"}, {"type": "object"}]}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
TextTokenIds = list[_int(ge=0, json_schema_extra={"x-token-id": "tokenizer"})]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


class _Request(BaseModel):
    # Unknown fields (user, service_tier, ...) are ignored, as most OpenAI-compatible servers do.
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*", mode="before")             # before the types: their checks say less
    @classmethod
    def _whole_characters(cls, value):
        """JSON may escape half of a UTF-16 pair alone ("\\ud800"), which is no character:
        no tokenizer takes it, so the field that holds it is a 400."""
        if _lone_surrogate(value):
            raise ValueError("holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                             "escape), which is not valid Unicode text")
        return value


def _lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_lone_surrogate(v) for v in value)
    return False


def _unsupported(message: str):
    """A validator for a field we accept only at its default; field validators (not model
    ones) so that the 400 names the field in `param`."""
    def check(cls, value, info: ValidationInfo):
        if value:
            raise ValueError(message)
        return value
    return check


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, any JSON object, or a JSON schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsFields(_Request):
    """vLLM's structured_outputs: exactly one constraint."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": [k], "properties": {k: {"const": True} if k == "json_object" else
                                         {"not": {"type": "null"}}}}
        for k in ("json", "json_object", "regex", "choice", "grammar")]})
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[NonEmpty] = None
    choice: Optional[Annotated[list[NonEmpty], Field(min_length=1)]] = None
    grammar: Optional[NonEmpty] = None


def _at_most_one(fields: dict[str, dict]) -> dict:
    """JSON Schema for "no two of these fields are set", each field set when it matches its
    schema in `fields`."""
    names = list(fields)
    return {"allOf": [{"not": {"required": [a, b], "properties": {a: fields[a], b: fields[b]}}}
                      for i, a in enumerate(names) for b in names[i + 1:]]}


SET = {"not": {"type": "null"}}
CONSTRAINTS = {"response_format": {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["json_object", "json_schema"]}}}, "structured_outputs": SET,
    "guided_json": SET, "guided_regex": SET, "guided_choice": SET, "guided_grammar": SET}


class _SamplingFields(_Request):
    """Fields shared by completions and chat, plus the usual non-OpenAI extras."""
    model_config = ConfigDict(json_schema_extra=_at_most_one(CONSTRAINTS))
    model: Optional[str] = None
    n: _int(ge=1, json_schema_extra={"x-max-num-seqs": True}) = 1
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stop: Union[NonEmpty, list[NonEmpty], None] = None
    seed: Optional[_int(ge=SEED_MIN, le=SEED_MAX)] = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                                   Field(json_schema_extra=TOKEN_ID_KEYS)]] = None
    # extras
    top_k: Int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: Int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[TokenIds] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's
    # older guided_* names; at most one of them
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsFields] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[NonEmpty] = None
    guided_choice: Optional[Annotated[list[NonEmpty], Field(min_length=1)]] = None
    guided_grammar: Optional[NonEmpty] = None
    # best_of > n and beam search (vLLM's names); neither streams
    best_of: Optional[_int(ge=1, json_schema_extra={"x-max-num-seqs": True})] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        if value and not all(k.isascii() and k.isdigit() for k in value):
            raise ValueError("logit_bias keys must be token ids (strings of digits)")
        return value

    @field_validator("seed")
    @classmethod
    def _seed_fits_a_generator(cls, value):
        # torch.Generator.manual_seed takes a signed or unsigned 64-bit integer; a larger seed
        # fails inside the batch's sampling step, where it takes the whole engine down.
        if value is not None and not -2**63 <= value < 2**64:
            raise ValueError("seed must fit in 64 bits")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever field gave it."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(StructuredOutputsParams(json_object=True, param="response_format"))
        if rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
            given.append(StructuredOutputsParams(json=schema, param="response_format"))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given.append(StructuredOutputsParams.from_dict(fields, "structured_outputs"))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append(StructuredOutputsParams(**{kind: value}, param=f"guided_{kind}"))
        if len(given) > 1:
            raise InvalidRequestError("give one output constraint: " + ", ".join(
                g.param for g in given) + " were all set", given[1].param)
        return given[0] if given else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream and (self.use_beam_search or (self.best_of or self.n) > self.n):
            raise InvalidRequestError("beam search and best_of > n do not stream (the best "
                                      "answers are known only at the end)", "stream")
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured(), best_of=self.best_of,
            use_beam_search=self.use_beam_search, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping)


class CompletionRequest(_SamplingFields):
    prompt: Union[NonEmpty, Annotated[list[NonEmpty], Field(min_length=1)],
                  Annotated[TokenIds, Field(min_length=1)],
                  Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Optional[_int(ge=1)] = 16
    logprobs: Optional[_int(ge=0, le=MAX_LOGPROBS)] = None
    echo: bool = False
    suffix: Annotated[Optional[str], WithJsonSchema({
        "anyOf": [{"const": ""}, {"type": "null"}], "description": "not supported: empty or null"})
    ] = None

    _no_suffix = field_validator("suffix")(_unsupported("suffix is not supported"))

    def prompts(self) -> list[str | TokenIds]:
        """One engine prompt per entry: a string, a list of strings, ids, or a list of ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:       # score the prompt too (lm-eval style)
            params.prompt_logprobs = self.logprobs
        return params


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str                                     # JSON text


class MessageToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # content is required, but an assistant's turn with tool_calls may leave it out; only an
    # assistant's turn carries tool_calls.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"anyOf": [{"required": ["content"]}, {"required": ["tool_calls"]}]},
        {"if": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
         "then": {"properties": {"role": {"const": "assistant"}}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, though it may be null; an assistant turn that made calls may leave it out.
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None     # an assistant's earlier calls
    tool_call_id: Optional[str] = None                     # a tool result's call

    @model_validator(mode="after")
    def _content_given(self):
        if not {"content", "tool_calls"} & self.model_fields_set:
            raise ValueError("a message needs content (null only for an assistant's tool calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """What the chat template sees: content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


FORCED_TOOLS = {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}


class ChatCompletionRequest(_SamplingFields):
    # top_logprobs needs logprobs; forced tool calls leave no room for another constraint.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        *_at_most_one(CONSTRAINTS)["allOf"],
        *[{"not": {"required": ["tool_choice", name],
                   "properties": {**FORCED_TOOLS, name: schema}}}
          for name, schema in CONSTRAINTS.items()],
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": SET}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        TOOLS_NEEDED]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[_int(ge=1)] = None
    max_completion_tokens: Optional[_int(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Optional[_int(ge=0, le=MAX_LOGPROBS)] = None
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True

    def tool_request(self) -> ToolRequest:
        """The tools, the choice and what forcing it takes; errors name tools or tool_choice."""
        return ToolRequest.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except InvalidRequestError as e:
            if e.param == "logprobs":                    # the chat name of that field
                e.param = "top_logprobs"
            if e.param == "max_tokens" and self.max_completion_tokens is not None:
                e.param = "max_completion_tokens"
            raise


class TokenizeRequest(_Request):
    # Exactly one of prompt and messages (neither may be null).
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]},
                                                           {"required": ["messages"]}],
                                                 "allOf": [TOOLS_NEEDED]})
    model: Optional[str] = None
    prompt: str = None
    messages: list[ChatMessage] = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    # With messages, as a chat request renders them (the tools' system text included).
    tools: Tools = None
    tool_choice: ToolChoice = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: TextTokenIds
