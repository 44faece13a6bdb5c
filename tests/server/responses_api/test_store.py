"""ResponseStore: bounded, oldest dropped first; a stored response keeps its conversation with
its own answer appended (text and calls as the assistant's turn)."""
from __future__ import annotations

from kvslim.server.responses_api.objects import ResponseObject, output_items
from kvslim.server.responses_api.store import ResponseStore
from kvslim.tools.spec import ToolCall


def response(i: int, text: str = "hi", calls=()) -> ResponseObject:
    rid = f"resp_{i}"
    return ResponseObject(id=rid, model="m", output=output_items(rid, text, list(calls)))


def test_the_oldest_is_dropped_past_capacity():
    store = ResponseStore(2)
    for i in range(3):
        store.put(response(i), [{"role": "user", "content": str(i)}])
    assert len(store) == 2 and store.get("resp_0") is None
    assert store.get("resp_2").messages == [{"role": "user", "content": "2"},
                                            {"role": "assistant", "content": "hi"}]


def test_capacity_zero_keeps_nothing():
    store = ResponseStore(0)
    store.put(response(0), [])
    assert len(store) == 0 and store.get("resp_0") is None


def test_calls_become_the_assistants_tool_calls():
    store = ResponseStore(4)
    call = ToolCall("f", '{"a": 1}', id="call_x")
    store.put(response(1, "", [call]), [])
    assert store.get("resp_1").messages == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert store.delete("resp_1") and not store.delete("resp_1")
