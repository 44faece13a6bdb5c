"""What schemathesis is told of kvslim's API beyond its schema: the rules JSON Schema cannot
state, written in the schema's descriptions instead (server/openapi.py) —

  * the prompt, as the server renders it, plus max_tokens must fit in max_model_len (a
    Responses request: its input as the chat messages it becomes, plus max_output_tokens);
  * previous_response_id must name a stored response (none is, for generated cases);
  * each input to embed, as the server tokenizes it, must fit in max_model_len;
  * min_tokens must not exceed max_tokens;
  * a JSON constraint's shortest document must fit in max_tokens;
  * tools name their functions once each, and a named tool_choice names one of them;
  * an output constraint (a JSON schema, JSON text of one, a regex, a grammar; the tools'
    parameter schemas when calls are forced) is one the grammar library compiles.

A case generated as valid that breaks one is not valid, so it is dropped instead of sent (the
server's 400 for each is tested in tests/server/test_server_errors.py). The prompt is counted by
the server's own /tokenize, chat prompts with their tools, so the rule is the server's to the
token. Loaded with SCHEMATHESIS_HOOKS=<this file>; KVSLIM_SERVER_URL names the live server."""
from __future__ import annotations

import json
import os

import httpx
import schemathesis

GENERATING = ("/v1/completions", "/v1/chat/completions")


@schemathesis.hook
def filter_case(ctx, case) -> bool:
    body = case.body
    if case.meta is None or not case.meta.generation.mode.is_positive \
            or not isinstance(body, dict):
        return True
    if case.operation.path == "/tokenize":
        return _tools_agree(body.get("tools"), body.get("tool_choice"))
    if case.operation.path == "/v1/embeddings":
        counts, limit = _prompt_counts({"prompt": body.get("input")}, chat=False)
        return counts is None or all(n <= limit for n in counts)   # nothing is generated
    if case.operation.path == "/v1/responses":
        if body.get("previous_response_id") is not None:
            return False                     # no generated id names a stored response
        body = _as_chat(body)
        if body is None:                     # the server's 400 (its model refuses it)
            return True
    elif case.operation.path not in GENERATING:
        return True
    chat = case.operation.path != "/v1/completions"
    max_tokens = (body.get("max_completion_tokens") or body.get("max_tokens")) if chat \
        else body.get("max_tokens", 16)
    if max_tokens is not None and body.get("min_tokens", 0) > max_tokens:
        return False
    if not _tools_agree(body.get("tools"), body.get("tool_choice")) \
            or not _constraints_compile(body) or not _shortest_json_fits(body, max_tokens):
        return False
    counts, limit = _prompt_counts(body, chat)
    if counts is None:                       # /tokenize refused it: the real request will too
        return True
    for n in counts:                         # max_tokens unset: what the context leaves
        budget = max_tokens if max_tokens is not None else limit - n
        if n >= limit or n + budget > limit or body.get("min_tokens", 0) > budget:
            return False
    return True


def _as_chat(body: dict) -> dict | None:
    """A Responses request as the chat request the server runs for it."""
    import pydantic
    from kvslim.errors import InvalidRequestError
    from kvslim.server.responses_api.protocol import ResponsesRequest
    try:
        return ResponsesRequest.model_validate(body).chat_request([]).model_dump(
            mode="json", by_alias=True, exclude_none=True)
    except (pydantic.ValidationError, InvalidRequestError):
        return None


def _tools_agree(tools, choice) -> bool:
    names = [t["function"]["name"] for t in tools or [] if isinstance(t, dict)
             and isinstance(t.get("function"), dict) and "name" in t["function"]]
    if len(set(names)) < len(names):
        return False
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return choice["function"].get("name") in names
    return True


def _constraints_compile(body: dict) -> bool:
    """Only the library's verdict on each constraint: every other check is the server's own, for
    schemathesis to judge."""
    import llguidance
    from kvslim.errors import InvalidRequestError
    from kvslim.structured.grammar import GrammarCompiler
    from kvslim.structured.params import StructuredOutputsParams
    from kvslim.tools.chat import ToolRequest
    constraints = []
    fields = dict(body.get("structured_outputs") or {})
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
        fields.setdefault("json", rf["json_schema"].get("schema") or {})
    for kind in ("json", "regex", "grammar"):
        for value in (fields.get(kind), body.get(f"guided_{kind}")):
            if value is not None:
                constraints.append({kind: value})
    if body.get("tools") and body.get("tool_choice") not in (None, "none", "auto"):
        try:
            forcing = ToolRequest.of(body["tools"], body["tool_choice"],
                                     body.get("parallel_tool_calls")).forcing()
        except InvalidRequestError:              # not about compiling: the server's to answer
            forcing = None
        if forcing is not None:
            constraints.append({"grammar": forcing.grammar})
    compiler = GrammarCompiler(None, 0, [])
    for constraint in constraints:
        try:
            grammar = compiler._grammar_text(StructuredOutputsParams(**constraint))
            if llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)[0]:
                return False
        except InvalidRequestError:
            return False
    return True


def _shortest_json_fits(body: dict, max_tokens: int | None) -> bool:
    """The server refuses a JSON constraint whose shortest document takes more tokens than
    max_tokens; a token holds at least one byte, so one of at most max_tokens bytes fits (a
    longer one may not: dropped, not guessed)."""
    from kvslim.structured.schema_shape import SchemaShape, Unsupported
    if max_tokens is None:
        return True
    rf = body.get("response_format") or {}
    fields = body.get("structured_outputs") or {}
    if rf.get("type") == "json_object" or fields.get("json_object"):
        return max_tokens >= 2
    schemas = [fields.get("json"), body.get("guided_json")]
    if rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
        schemas.append(rf["json_schema"].get("schema") or {})
    for schema in schemas:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                continue
        if not isinstance(schema, (dict, bool)):
            continue
        try:
            shortest = SchemaShape(schema).root.min
        except (Unsupported, RecursionError, TypeError, ValueError):
            continue                     # closed by syntax alone: not refused for its length
        if len(shortest) > max_tokens:
            return False
    return True


def _prompt_counts(body: dict, chat: bool) -> tuple[list[int] | None, int]:
    if chat:
        request = {k: body[k] for k in ("messages", "tools", "tool_choice", "add_generation_prompt")
                   if k in body}
        return _tokenize([request])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = prompt
    else:
        return None, 0
    texts = [{"prompt": p} for p in prompts if isinstance(p, str)]
    counts, limit = _tokenize(texts) if texts else ([], _tokenize([{"prompt": ""}])[1])
    if counts is None:
        return None, 0
    return counts + [len(p) for p in prompts if isinstance(p, list)], limit


def _tokenize(requests: list[dict]) -> tuple[list[int] | None, int]:
    counts, limit = [], 0
    with httpx.Client(base_url=os.environ["KVSLIM_SERVER_URL"], timeout=30) as http:
        for request in requests:
            answer = http.post("/tokenize", json=request)
            if answer.status_code != 200:
                return None, 0
            counts.append(answer.json()["count"])
            limit = answer.json()["max_model_len"]
    return counts, limit
