"""Every bad request gets its status and OpenAI's error body, and the server keeps serving:
a normal request right after each one still returns the right greedy text."""
from __future__ import annotations

import httpx
import openai
import pytest
from live_server import API_KEY

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
LONG_PROMPT = [5] * 600                                  # max_model_len is 512

CASES = {
    # name: (path, JSON body or raw bytes, status, param)
    "max_tokens_zero": (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens_negative": (CHAT, {"messages": OK_MESSAGES, "max_tokens": -3}, 400, "max_tokens"),
    "temperature_negative": (COMPLETIONS, {"prompt": "a", "temperature": -0.5}, 400,
                             "temperature"),
    "top_p_zero": (COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    "top_p_above_one": (CHAT, {"messages": OK_MESSAGES, "top_p": 1.5}, 400, "top_p"),
    "n_zero": (COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n"),
    "n_above_max_num_seqs": (COMPLETIONS, {"prompt": "a", "n": 65}, 400, "n"),   # serve: 64
    "best_of_above_max_num_seqs": (COMPLETIONS, {"prompt": "a", "n": 65, "best_of": 65}, 400,
                                   "n"),
    "seed_beyond_64_bits": (COMPLETIONS, {"prompt": "a", "seed": 2**70}, 400, "seed"),
    "seed_below_64_bits": (CHAT, {"messages": OK_MESSAGES, "seed": -2**63 - 1}, 400, "seed"),
    "over_max_model_len": (COMPLETIONS, {"prompt": "a b c", "max_tokens": 510}, 400,
                           "max_tokens"),
    "prompt_too_long": (COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    "empty_prompt": (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    "token_outside_vocab": (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt"),
    "empty_messages": (CHAT, {"messages": []}, 400, "messages"),
    "message_without_content": (CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    "max_tokens_string": (COMPLETIONS, {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    "temperature_string": (CHAT, {"messages": OK_MESSAGES, "temperature": "hot"}, 400,
                           "temperature"),
    "messages_string": (CHAT, {"messages": "hi"}, 400, "messages"),
    "prompt_number": (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    "missing_prompt": (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    "penalty_out_of_range": (COMPLETIONS, {"prompt": "a", "presence_penalty": 3}, 400,
                             "presence_penalty"),
    "top_logprobs_without_logprobs": (CHAT, {"messages": OK_MESSAGES, "top_logprobs": 2}, 400,
                                      "top_logprobs"),
    "logit_bias_key_not_an_id": (COMPLETIONS, {"prompt": "a", "logit_bias": {"cat": 1.0}}, 400,
                                 "logit_bias"),
    "logit_bias_out_of_range": (CHAT, {"messages": OK_MESSAGES, "logit_bias": {"5": 101}}, 400,
                                "logit_bias"),
    "logit_bias_outside_vocab": (COMPLETIONS, {"prompt": "a", "logit_bias": {"999999": 1}}, 400,
                                 "logit_bias"),
    # JSON escapes half of a UTF-16 pair alone: no character, no tokenizer takes it
    "prompt_lone_surrogate": (COMPLETIONS, b'{"prompt": "Hi \\ud800 there", "max_tokens": 2}', 400,
                              "prompt"),
    "message_lone_surrogate": (CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
                               400, "messages"),
    "stop_lone_surrogate": (COMPLETIONS, b'{"prompt": "a", "stop": ["\\ud83d"]}', 400, "stop"),
    "malformed_json": (COMPLETIONS, b'{"prompt": "a", "max_tokens": ', 400, None),
    "body_not_an_object": (COMPLETIONS, b'[1, 2]', 400, None),
    "unknown_model": (COMPLETIONS, {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    "unknown_model_chat": (CHAT, {"model": "gpt-4", "messages": OK_MESSAGES}, 404, "model"),
    "unknown_route": ("/v1/images/generations", {"prompt": "a"}, 404, None),
    # structured outputs
    "invalid_json_schema": (CHAT, {"messages": OK_MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400, "response_format"),
    "json_schema_without_schema_object": (CHAT, {"messages": OK_MESSAGES, "response_format": {
        "type": "json_schema"}}, 400, "response_format"),
    "response_format_unknown_type": (COMPLETIONS, {"prompt": "a", "response_format": {
        "type": "yaml"}}, 400, "response_format"),
    "regex_the_library_lacks": (COMPLETIONS, {"prompt": "a", "structured_outputs": {
        "regex": "(?<=a)b"}}, 400, "structured_outputs"),
    "broken_grammar": (CHAT, {"messages": OK_MESSAGES, "guided_grammar": "start: nowhere"},
                       400, "guided_grammar"),
    "two_constraints": (COMPLETIONS, {"prompt": "a", "guided_regex": "a+",
                                      "guided_choice": ["a"]}, 400, "guided_choice"),
    "unknown_structured_field": (COMPLETIONS, {"prompt": "a", "structured_outputs": {
        "yaml": "x"}}, 400, "structured_outputs"),
    "empty_choice": (COMPLETIONS, {"prompt": "a", "guided_choice": []}, 400, "guided_choice"),
    # beam search and best_of
    "beam_width_above_max_num_seqs": (COMPLETIONS, {"prompt": "a", "use_beam_search": True,
                                                    "best_of": 65}, 400, "best_of"),
    "best_of_below_n": (COMPLETIONS, {"prompt": "a", "n": 3, "best_of": 2}, 400, "best_of"),
    "beam_search_streamed": (CHAT, {"messages": OK_MESSAGES, "use_beam_search": True,
                                    "stream": True}, 400, "stream"),
    "beam_search_with_a_schema": (CHAT, {"messages": OK_MESSAGES, "use_beam_search": True,
                                         "guided_regex": "a+"}, 400, "use_beam_search"),
    "early_stopping_unknown": (COMPLETIONS, {"prompt": "a", "use_beam_search": True,
                                             "early_stopping": "soon"}, 400, "early_stopping"),
    # tools
    "tool_without_name": (CHAT, {"messages": OK_MESSAGES, "tools": [
        {"type": "function", "function": {"description": "x"}}]}, 400, "tools"),
    "tool_choice_unknown_function": (CHAT, {"messages": OK_MESSAGES, "tools": [TOOL],
                                            "tool_choice": {"type": "function",
                                                            "function": {"name": "g"}}},
                                     400, "tool_choice"),
    "tool_choice_required_without_tools": (CHAT, {"messages": OK_MESSAGES,
                                                  "tool_choice": "required"}, 400, "tool_choice"),
    "tool_choice_required_and_a_schema": (CHAT, {"messages": OK_MESSAGES, "tools": [TOOL],
                                                 "tool_choice": "required",
                                                 "guided_regex": "a"}, 400, "tool_choice"),
    "tool_with_invalid_parameters": (CHAT, {"messages": OK_MESSAGES, "tool_choice": "required",
                                            "tools": [{"type": "function", "function": {
                                                "name": "f", "parameters": {
                                                    "type": "object", "properties": {
                                                        "a": {"type": "strin"}}}}}]},
                                     400, "tool_choice"),
    "tool_calls_on_a_user_message": (CHAT, {"messages": [{"role": "user", "content": "a",
                                                          "tool_calls": [{
                                                              "id": "c", "type": "function",
                                                              "function": {"name": "f",
                                                                           "arguments": "{}"}}]}]},
                                     400, "messages"),
}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] == param
    return body["error"]


def assert_still_serving(http, reference):
    expected = reference.generate("It is a truth", _greedy(), use_tqdm=False)[0].outputs[0]
    response = http.post(COMPLETIONS, json={"model": "tiny", "prompt": "It is a truth",
                                            "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected.text


def _greedy():
    from kvslim.engine.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize("name", CASES)
def test_bad_request_gets_openai_error_then_server_serves(http, reference, name):
    path, body, status, param = CASES[name]
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    error = assert_openai_error(response, status, param)
    assert error["type"] == "invalid_request_error"
    if name.startswith("unknown_model"):
        assert error["code"] == "model_not_found"
    if name.endswith("surrogate"):
        assert "lone UTF-16 surrogate" in error["message"], error
    assert_still_serving(http, reference)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"},
                                     {"Authorization": f"Basic {API_KEY}"},
                                     {"Authorization": API_KEY[:-1]}])
def test_missing_or_wrong_key_is_401(server, reference, headers):
    with httpx.Client(base_url=server.url, headers=headers) as anonymous:
        for path, method in (("/v1/models", "GET"), (COMPLETIONS, "POST"), ("/tokenize", "POST")):
            response = anonymous.request(method, path, json={"prompt": "a"})
            error = assert_openai_error(response, 401)
            assert error["code"] == "invalid_api_key"
        assert anonymous.get("/health").status_code == 200          # probes need no key
        assert anonymous.get("/metrics").status_code == 200
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        assert_still_serving(http, reference)


def test_openai_client_raises_typed_errors(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="a", max_tokens=0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=OK_MESSAGES)
    assert missing.value.body["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_bad_stream_request_fails_before_streaming(http):
    """Validation happens before the first SSE byte: a plain 400, not an event stream."""
    response = http.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 600, "stream": True})
    assert_openai_error(response, 400, "max_tokens")
    assert response.headers["content-type"].startswith("application/json")
