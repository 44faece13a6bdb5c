"""Server-sent events and client connections: the SSE framing OpenAI clients parse, and
cancelling a non-streaming route when its client goes away (streaming routes are cancelled by
Starlette itself)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable

from fastapi import Request, Response
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
# Never sent (the client is gone); the status the metrics record, after nginx's convention.
CLIENT_CLOSED_REQUEST = 499


def sse(event: BaseModel | dict) -> str:
    data = event.model_dump_json() if isinstance(event, BaseModel) else json.dumps(event)
    return f"data: {data}\n\n"


async def _until_disconnected(request: Request) -> None:
    # FastAPI has read the whole body, so the next message is the disconnect (or nothing).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable) -> Response:
    """Run a route's work; if the client disconnects first, cancel it (its `finally` aborts the
    engine requests, freeing their KV blocks) instead of generating for nobody."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:                       # the server cancels us: pass it on
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=CLIENT_CLOSED_REQUEST)
