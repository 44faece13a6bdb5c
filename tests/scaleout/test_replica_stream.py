"""What the API server does when a replica dies under a request (kvslim.scaleout.stream), with
stand-in actors: no Ray runtime, only Ray's exception classes. A request of which nothing was
streamed is sent once more, to another replica; one that had streamed fails; a refusal is the
replica's error as is; the router's in-flight counts return to zero either way."""
from __future__ import annotations

import asyncio

import pytest

ray = pytest.importorskip("ray", reason="the replicas run on Ray: pip install 'kvslim[ray]'")

from kvslim.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from kvslim.engine.sampling_params import SamplingParams  # noqa: E402
from kvslim.errors import InvalidRequestError  # noqa: E402
from kvslim.scaleout.pool import ReplicaHandle, ReplicaPool  # noqa: E402
from kvslim.scaleout.replica import ACCEPTED, ReplicaFacts  # noqa: E402
from kvslim.server.async_engine import EngineDeadError, RequestFailedError  # noqa: E402

DIES = "dies"


def output(request_id: str, token: int, finished: bool) -> tuple[int, RequestOutput]:
    completion = CompletionOutput(0, "x", [token], finish_reason="length" if finished else None,
                                  delta_text="x", delta_token_ids=[token])
    return 0, RequestOutput(request_id, "p", [1, 2], [completion], finished, RequestMetrics(0.0))


class FakeOutputs:
    """An ObjectRefGenerator's async iteration over scripted items; DIES raises Ray's
    ActorDiedError there, as a killed actor's stream does."""

    def __init__(self, items):
        self.items = iter(items)

    async def __anext__(self):
        item = next(self.items, StopAsyncIteration)
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if item == DIES:
            raise ray.exceptions.ActorDiedError()

        async def ref():
            return item
        return ref()


class FakeMethod:
    def __init__(self, script):
        self.script, self.calls = script, []

    def options(self, **_):
        return self

    def remote(self, *args):
        self.calls.append(args)
        return FakeOutputs(self.script(*args)) if callable(self.script) else None


class FakeActor:
    def __init__(self, script):
        self.generate = FakeMethod(script)
        self.abort = FakeMethod(None)


def serves(request_ids, *_):
    return [ACCEPTED, output(request_ids[0], 5, False), output(request_ids[0], 6, True)]


def pool_of(*scripts) -> ReplicaPool:
    replicas = [ReplicaHandle(i, FakeActor(s), None, ready=True) for i, s in enumerate(scripts)]
    facts = ReplicaFacts("m", 512, 320, 64, 8, 100, 16, 1600)
    return ReplicaPool(None, replicas, None, facts, routing="round-robin")


def run(pool: ReplicaPool) -> list[int]:
    async def go():
        stream = await pool.add(["r0"], [[1, 2]], SamplingParams(max_tokens=2))
        return [out.outputs[0].delta_token_ids[0] async for _, out in stream]
    return asyncio.run(go())


def test_a_replica_that_dies_before_streaming_is_replaced_once():
    for early in ([DIES], [ACCEPTED, DIES]):
        pool = pool_of(lambda *a, items=early: items, serves)
        assert run(pool) == [5, 6]
        assert [r.ready for r in pool.replicas] == [False, True]
        assert len(pool.replicas[1].actor.generate.calls) == 1
        assert pool.router.load == [0, 0]
        assert pool.health()["status"] == "degraded"


def test_a_request_that_streamed_fails_with_its_replica():
    pool = pool_of(lambda ids, *a: [ACCEPTED, output(ids[0], 5, False), DIES], serves)
    with pytest.raises(RequestFailedError, match="replica 0 died"):
        run(pool)
    assert pool.replicas[1].actor.generate.calls == []
    assert pool.router.load == [0, 0]


def test_a_second_death_is_not_retried_again():
    pool = pool_of(lambda *a: [DIES], lambda *a: [ACCEPTED, DIES])
    with pytest.raises(RequestFailedError, match="replica 1 died"):
        run(pool)
    assert pool.router.load == [0, 0] and not pool.is_alive
    with pytest.raises(EngineDeadError):
        run(pool)


def test_a_refusal_is_the_replicas_error():
    refusal = InvalidRequestError("max_tokens is too large", "max_tokens")
    pool = pool_of(lambda *a: [refusal], serves)
    with pytest.raises(InvalidRequestError, match="too large") as caught:
        run(pool)
    assert caught.value.param == "max_tokens"
    assert pool.router.load == [0, 0] and all(r.ready for r in pool.replicas)


def test_abort_reaches_the_replica_that_holds_the_request():
    pool = pool_of(serves, serves)

    async def go():
        first = await pool.add(["a"], [[1]], SamplingParams())
        second = await pool.add(["b"], [[1]], SamplingParams())
        pool.abort(["b", "unknown"])
        return first, second
    asyncio.run(go())
    assert pool.replicas[1].actor.abort.calls == [(["b"],)]
    assert pool.replicas[0].actor.abort.calls == []
    assert pool.router.load == [1, 0]
