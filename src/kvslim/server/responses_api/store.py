"""The responses kept for `previous_response_id`: a bounded in-memory map, oldest dropped
first (a restart forgets them all). Each keeps the conversation it continued, as chat
messages, and its own answer appended, so that a follow-up sees the whole exchange."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvslim.server.responses_api.objects import FunctionCallOutput, ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict[str, Any]]          # input (without instructions) + the answer


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self._items[response.id] = StoredResponse(response, conversation + answer(response))
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def answer(response: ResponseObject) -> list[dict[str, Any]]:
    """A response's output as the chat messages of the assistant's turn."""
    text = "".join(part.text for item in response.output if item.type == "message"
                   for part in item.content)
    calls = [{"id": item.call_id, "type": "function",
              "function": {"name": item.name, "arguments": item.arguments}}
             for item in response.output if isinstance(item, FunctionCallOutput)]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
