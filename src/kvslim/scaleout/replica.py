"""`Replica`: one engine replica, the class of a Ray actor (pool.py makes it one, so that this
file needs no Ray to be read): the model loaded in the actor's process, the `AsyncEngine`
that the single-engine server runs (server/async_engine.py) driving it, and the methods the
API server calls across Ray.

The actor is asynchronous: its methods run on one event loop, the engine on its own thread, as
in `kvslim serve`. `generate` is a streaming method: it yields a request's outputs as the engine
makes them, after a first item that says the engine took the request (or the error that
refused it), so that the API server answers 400 before it starts streaming. Errors travel as
items, not as Ray's wrapped exceptions: the API server raises them as they are.

If the engine thread dies of an error, the process exits (after its open requests got their
error): Ray restarts the actor, which loads the model again, as a supervisor restarts
`kvslim serve`."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams
from kvslim.lora.request import LoRARequest
from kvslim.scaleout.ranks import RankLauncher
from kvslim.server.async_engine import AsyncEngine, Prompt, RequestStream
from kvslim.server.metrics import SERVER_SERIES, ServerMetrics

ACCEPTED = "accepted"                 # generate's first item when the engine took the request
EXIT_AFTER_CRASH_S = 1.0              # for the failed requests' errors to reach the API server


@dataclass(frozen=True)
class ReplicaSpec:
    model: str | None
    engine_options: dict              # EngineConfig's keywords
    threads: int                      # torch threads of each rank
    cpus_per_rank: float              # what Ray reserves for each rank (its bundle)
    gpus_per_rank: int

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine_options.get("tensor_parallel_size", 1)


@dataclass(frozen=True)
class ReplicaFacts:
    """What the API server needs of the model the replicas run."""
    model_dir: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    max_tokens: int                   # token slots of the KV cache


@dataclass(frozen=True)
class ReplicaStatus:
    incarnation: str                  # changes when Ray restarts the actor
    alive: bool                       # the engine thread runs
    num_running: int
    num_waiting: int
    pid: int


class _Aborted(Exception):
    """Put into a request's stream by `abort`, so that its `generate` ends."""


class Replica:
    def __init__(self, index: int, spec: ReplicaSpec):
        torch.set_num_threads(spec.threads)
        self.index = index
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.ranks = RankLauncher.start(spec) if spec.tensor_parallel_size > 1 else None
        try:
            self.llm = LLM(spec.model, **spec.engine_options)
        except BaseException:
            if self.ranks is not None:
                self.ranks.kill()
            raise
        self.metrics = ServerMetrics(f"replica-{index}")
        self.engine = AsyncEngine(self.llm.engine, self.metrics, on_crash=self._crashed)
        self._streams: dict[str, RequestStream] = {}
        self._started = False

    def _ensure_started(self) -> None:
        """The engine thread, started from the actor's event loop (AsyncEngine needs one)."""
        if not self._started:
            self._started = True
            self.engine.start()

    def _crashed(self) -> None:
        asyncio.get_running_loop().call_later(EXIT_AFTER_CRASH_S, os._exit, 1)

    # ---- what the API server calls -------------------------------------------------------
    def facts(self) -> ReplicaFacts:
        engine = self.llm.engine
        stats = engine.kv_cache_stats()
        return ReplicaFacts(str(self.llm.model_dir), engine.max_model_len,
                            engine.model_config.vocab_size, engine.model_config.hidden_size,
                            engine.config.max_num_seqs, stats.num_blocks, stats.block_size,
                            stats.max_tokens)

    async def ping(self) -> ReplicaStatus:
        self._ensure_started()
        engine = self.llm.engine
        return ReplicaStatus(self.incarnation, self.engine.is_alive, engine.num_running,
                             engine.num_waiting, os.getpid())

    async def generate(self, request_ids: list[str], prompts: list[Prompt],
                       params: SamplingParams, lora: LoRARequest | None = None):
        """ACCEPTED, then `(prompt_index, RequestOutput)` pairs until every request finished;
        an error (refused, failed, engine dead) is the last item."""
        self._ensure_started()
        try:
            stream = await self.engine.add(request_ids, prompts, params, lora_request=lora)
        except Exception as e:                       # noqa: BLE001 - the API server raises it
            yield e
            return
        yield ACCEPTED
        for request_id in request_ids:
            self._streams[request_id] = stream
        try:
            async for item in stream:
                yield item
        except _Aborted:
            return
        except Exception as e:                       # noqa: BLE001 - the API server raises it
            yield e
        finally:
            for request_id in request_ids:
                self._streams.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)
        streams = {id(s): s for s in (self._streams.pop(r, None) for r in request_ids) if s}
        for stream in streams.values():
            stream.put(_Aborted())

    async def call(self, fn: Callable) -> tuple[bool, Any]:
        """(True, fn(engine)) run on the engine thread, or (False, its error)."""
        self._ensure_started()
        try:
            return True, await self.engine.call(fn)
        except Exception as e:                       # noqa: BLE001 - the API server raises it
            return False, e

    def metrics_snapshot(self) -> list:
        """The engine's series now (prometheus_client's Metric families), without those the
        API server keeps itself."""
        return [family for family in self.metrics.registry.collect()
                if family.name not in SERVER_SERIES]

    async def stop(self) -> None:
        """The engine thread and the tensor-parallel ranks ended (the pool then kills the
        actor)."""
        if self._started:
            await self.engine.stop()
        self.llm.shutdown()
        if self.ranks is not None:
            await self.ranks.leave()
