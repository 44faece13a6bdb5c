"""`ReplicaStream`: one HTTP request's outputs from the replica the router chose, with the
interface of server/async_engine.py's `RequestStream` (the routes cannot tell them apart).

`open` routes the request, starts the replica's streaming `generate` and waits for its first
item: the engine took the request, or its error (a bad request is then a 400, as with one
engine). Iterating yields `(prompt_index, RequestOutput)` pairs until every prompt finished.

If the replica's process dies (Ray reports the actor gone), a request of which nothing was
streamed yet is sent once more, to another ready replica; one that had streamed ends with
RequestFailedError (a 500, or an error event in its stream), as the client already holds part
of an answer that another replica's sampling would not continue."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from kvslim.engine.outputs import RequestOutput
from kvslim.scaleout.ray_runtime import first_line, import_ray
from kvslim.scaleout.replica import ACCEPTED
from kvslim.server.async_engine import Prompt, RequestFailedError


class Replicas(Protocol):
    """What a stream asks of the pool (pool.py's ReplicaPool): a replica handle has `index`
    and `actor`."""

    def route(self, tokens: list[list[int]], exclude: tuple[int, ...]) -> Any: ...

    def track(self, request_ids: list[str], replica: Any) -> None: ...

    def untrack(self, request_ids: list[str]) -> None: ...

    def lost(self, replica: Any) -> None: ...


class ReplicaLost(Exception):
    """The replica serving the request died."""


class ReplicaStream:
    def __init__(self, pool: Replicas, request_ids: list[str], prompts: list[Prompt],
                 params, lora, tokens: list[list[int]]):
        self.pool = pool
        self.request_ids = request_ids
        self._request = (prompts, params, lora)
        self._tokens = tokens
        self._replica = None                        # the pool's ReplicaHandle
        self._outputs = None                        # the replica's ObjectRefGenerator
        self._unfinished = set(request_ids)
        self._streamed = False                      # an output went to the route
        self._retried = False

    async def open(self, exclude: tuple[int, ...] = ()) -> None:
        """Route and submit; raises what refused the request (InvalidRequestError: 400;
        EngineDeadError when no replica runs). A replica that dies before it answers is
        replaced once."""
        replica = self.pool.route(self._tokens, exclude)
        prompts, params, lora = self._request
        self._replica = replica
        self._outputs = replica.actor.generate.options(num_returns="streaming").remote(
            self.request_ids, prompts, params, lora)
        self.pool.track(self.request_ids, replica)
        try:
            first = await self._receive()
        except ReplicaLost as e:
            await self._retry(e)
            return
        if first != ACCEPTED:
            self.pool.untrack(self.request_ids)
            raise first if isinstance(first, BaseException) else \
                RequestFailedError(f"unexpected answer from replica {replica.index}: {first!r}")

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            try:
                item = await self._receive()
            except ReplicaLost as e:
                await self._retry(e)
                continue
            if isinstance(item, BaseException):
                self.pool.untrack(list(self._unfinished))
                raise item
            index, output = item
            if output.error is not None:
                self.pool.untrack(list(self._unfinished))
                raise RequestFailedError(output.error)
            self._streamed = True
            if output.finished:
                self._unfinished.discard(output.request_id)
                self.pool.untrack([output.request_id])
            yield index, output

    async def _retry(self, lost: ReplicaLost) -> None:
        """Once, to another replica, while nothing was streamed; else the request fails."""
        self.pool.untrack(list(self._unfinished))
        if self._streamed or self._retried:
            raise RequestFailedError(str(lost))
        self._retried = True
        await self.open(exclude=(self._replica.index,))

    async def _receive(self):
        """The replica's next item; ReplicaLost if its actor died."""
        ray = import_ray()
        try:
            ref = await self._outputs.__anext__()
            return await ref
        except StopAsyncIteration:
            raise RequestFailedError(f"replica {self._replica.index} ended the stream before "
                                     f"the request finished") from None
        except ray.exceptions.RayActorError as e:
            self.pool.lost(self._replica)
            raise ReplicaLost(f"replica {self._replica.index} died while serving the request: "
                              f"{first_line(e)}") from None
        except ray.exceptions.RayError as e:
            raise RequestFailedError(f"replica {self._replica.index} failed: {first_line(e)}") \
                from None
