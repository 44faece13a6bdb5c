"""`ReplicaPool`: N engine replicas as Ray actors, and the API server's engine client over them
(what `AsyncEngine` is for one engine: start, stop, is_alive, add, call, abort, health,
collect_metrics).

Placement: each replica gets a placement group of one bundle per tensor-parallel rank (CPUs,
or a GPU each), packed on as few machines as Ray can; its actor runs in bundle 0 (ranks.py
starts the others). Ray chooses the machines.

Faults: Ray restarts a replica whose process died (`max_restarts=-1`, as a supervisor would);
its in-flight requests end with an error, or are sent once to another replica when nothing of
them was streamed yet (stream.py); the others' requests go on. A watcher pings every replica
each HEALTH_INTERVAL_S: a replica that does not answer is not routed to, and one that answers
after a restart (its incarnation changed) is routed to again with an empty prefix index.
/health is "ok" with every replica ready, "degraded" (still 200) with fewer, 503 with none."""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from kvslim.errors import KvslimError
from kvslim.scaleout.options import ScaleOutOptions
from kvslim.scaleout.ray_runtime import RayRuntime, first_line, import_ray
from kvslim.scaleout.replica import Replica, ReplicaFacts, ReplicaSpec, ReplicaStatus
from kvslim.scaleout.replica_metrics import ReplicaMetrics
from kvslim.scaleout.router import Route, Router, RouterConfig
from kvslim.scaleout.stream import ReplicaStream
from kvslim.server.async_engine import EngineDeadError, Prompt, RequestFailedError
from kvslim.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvslim.scaleout")

HEALTH_INTERVAL_S = 1.0
PING_TIMEOUT_S = 10.0                 # a replica busy with a long prefill still answers in this
METRICS_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 30.0
PLACEMENT_TIMEOUT_S = 120.0           # for Ray to find the bundles; else the cluster is too small


@dataclass
class ReplicaHandle:
    index: int
    actor: Any
    placement_group: Any
    ready: bool = False
    incarnation: str | None = None
    restarts: int = 0
    pid: int | None = None


def rank_resources(options: ScaleOutOptions, engine_options: dict, threads: int | None,
                   device_type: str, total_cpus: float) -> tuple[float, int, int]:
    """(CPUs, GPUs, torch threads) of each rank. On the CPU without --replica-cpus, the
    `total_cpus` (this machine's, or the cluster's) shared among every rank; Ray takes a whole
    number of CPUs, or a fraction of one when there are more ranks than CPUs."""
    ranks = options.data_parallel_size * engine_options.get("tensor_parallel_size", 1)
    if device_type == "cuda":
        return 1.0, 1, threads or 1
    cpus = options.replica_cpus
    if cpus is None:
        share = total_cpus / ranks
        cpus = float(math.floor(share)) if share >= 1 else math.floor(share * 100) / 100
    return cpus, 0, threads or max(1, math.floor(cpus))


class ReplicaPool:
    def __init__(self, runtime: RayRuntime, replicas: list[ReplicaHandle], tokenizer: Tokenizer,
                 facts: ReplicaFacts, routing: str):
        self.runtime = runtime
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.facts = facts
        self.router = Router(len(replicas), RouterConfig(
            routing, block_size=facts.block_size, capacity_blocks=facts.num_blocks))
        self.metrics = ReplicaMetrics(len(replicas))
        self._where: dict[str, ReplicaHandle] = {}       # live request id -> its replica
        self._watcher: asyncio.Task | None = None
        self._stopped = False

    # ---- start-up (before the HTTP server runs) ------------------------------------------
    @classmethod
    def launch(cls, runtime: RayRuntime, spec: ReplicaSpec, options: ScaleOutOptions,
               tokenizer: Tokenizer) -> "ReplicaPool":
        """Every replica placed, loaded and answering; any failure is one line, with nothing
        left running (`runtime` is shut down then)."""
        replicas: list[ReplicaHandle] = []
        try:
            replicas = _place(options.data_parallel_size, spec)
            facts = _load(replicas)
            pool = cls(runtime, replicas, tokenizer, facts, options.routing)
            for replica in replicas:
                pool._seen(replica, import_ray().get(replica.actor.ping.remote()))
            return pool
        except BaseException:
            _end(replicas)
            runtime.shutdown()
            raise

    # ---- the engine client's interface ---------------------------------------------------
    def start(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    @property
    def is_alive(self) -> bool:
        return not self._stopped and any(r.ready for r in self.replicas)

    def health(self) -> dict:
        ready = sum(r.ready for r in self.replicas)
        return {"status": "ok" if ready == len(self.replicas) else "degraded",
                "replicas": len(self.replicas), "replicas_ready": ready,
                "restarts": sum(r.restarts for r in self.replicas),
                "engines": [{"engine": r.index, "ready": r.ready, "restarts": r.restarts,
                             "pid": r.pid, "in_flight": self.router.load[r.index]}
                            for r in self.replicas]}

    async def add(self, request_ids: list[str], prompts: list[Prompt], params,
                  lora_request=None) -> ReplicaStream:
        stream = ReplicaStream(self, request_ids, prompts, params, lora_request,
                               self._prompt_tokens(prompts))
        await stream.open()
        return stream

    async def call(self, fn) -> Any:
        """`fn(engine)` on the least loaded replica's engine thread."""
        replica = self.route([], exclude=())
        try:
            ok, result = await replica.actor.call.remote(fn)
        except Exception as e:                       # noqa: BLE001 - Ray's: the replica died
            self.lost(replica)
            raise RequestFailedError(f"replica {replica.index} failed: {first_line(e)}") \
                from None
        if not ok:
            raise result
        return result

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self._where.get(request_id)
            if replica is not None:
                by_replica.setdefault(replica.index, []).append(request_id)
        self.untrack(request_ids)
        for index, ids in by_replica.items():
            if self.replicas[index].ready:
                self.replicas[index].actor.abort.remote(ids)     # no need to wait

    async def collect_metrics(self) -> None:
        async def one(replica: ReplicaHandle) -> None:
            try:
                families = await asyncio.wait_for(_result(replica.actor.metrics_snapshot
                                                          .remote()), METRICS_TIMEOUT_S)
            except Exception:                        # noqa: BLE001 - shown as not up
                return
            self.metrics.update(replica.index, families)
        await asyncio.gather(*(one(r) for r in self.replicas if r.ready))

    async def stop(self) -> None:
        """After the HTTP server drained: the replicas' engines stop (`shutdown` ends Ray)."""
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()
        calls = [_result(r.actor.stop.remote()) for r in self.replicas if r.ready]
        try:
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True),
                                   STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("replicas did not stop within %.0f s; killing them", STOP_TIMEOUT_S)

    def shutdown(self) -> None:
        """Disconnect from Ray (idempotent). The replicas and their placement groups belong to
        this driver's job, so Ray ends them with it; a local runtime stops with every process
        it started. Nothing here waits on Ray's control store, which a Ctrl-C (delivered to the
        local runtime's processes too) may already have stopped."""
        self._stopped = True
        self.runtime.shutdown()

    # ---- routing (stream.py) -------------------------------------------------------------
    def route(self, tokens: list[list[int]], exclude: tuple[int, ...]) -> ReplicaHandle:
        ready = [r.index for r in self.replicas if r.ready and r.index not in exclude]
        if not ready:
            raise EngineDeadError("no engine replica is running" if not exclude else
                                  "its replica died and no other replica is running")
        route: Route = self.router.choose(tokens, ready)
        return self.replicas[route.replica]

    def track(self, request_ids: list[str], replica: ReplicaHandle) -> None:
        for request_id in request_ids:
            self._where[request_id] = replica
        self.router.started(replica.index, len(request_ids))

    def untrack(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            replica = self._where.pop(request_id, None)
            if replica is not None:
                self.router.finished(replica.index)

    def lost(self, replica: ReplicaHandle) -> None:
        """A call to the replica failed as its process died: not routed to until it answers
        again (the watcher)."""
        if replica.ready:
            logger.warning("replica %d is gone; Ray restarts it", replica.index)
        replica.ready = False
        self.router.forget(replica.index)
        self.metrics.set_state(replica.index, False, replica.restarts)

    def _prompt_tokens(self, prompts: list[Prompt]) -> list[list[int]]:
        """What the prefix index keys on (the engine tokenizes the same way); none when the
        policy does not read prompts."""
        if self.router.config.policy != "prefix":
            return []
        tokens = []
        for prompt in prompts:
            try:
                tokens.append(list(prompt) if isinstance(prompt, list) else
                              self.tokenizer.encode(prompt))
            except Exception:                        # noqa: BLE001 - the replica says why
                tokens.append([])
        return tokens

    # ---- health --------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _check(self, replica: ReplicaHandle) -> None:
        try:
            status = await asyncio.wait_for(_result(replica.actor.ping.remote()),
                                            PING_TIMEOUT_S)
        except Exception:                            # noqa: BLE001 - dead, restarting or hung
            self.lost(replica)
            return
        self._seen(replica, status)

    def _seen(self, replica: ReplicaHandle, status: ReplicaStatus) -> None:
        if status.incarnation != replica.incarnation:
            if replica.incarnation is not None:      # Ray restarted it: its cache is empty
                replica.restarts += 1
                self.router.forget(replica.index)
                logger.warning("replica %d restarted (pid %d)", replica.index, status.pid)
            replica.incarnation, replica.pid = status.incarnation, status.pid
        replica.ready = status.alive and not self._stopped
        self.metrics.set_state(replica.index, replica.ready, replica.restarts)


async def _result(ref) -> Any:
    return await ref


def _place(n: int, spec: ReplicaSpec) -> list[ReplicaHandle]:
    """A placement group and an actor per replica (the actors start loading at once)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    bundle = {"CPU": spec.cpus_per_rank, **({"GPU": spec.gpus_per_rank}
                                             if spec.gpus_per_rank else {})}
    groups = [placement_group([bundle] * spec.tensor_parallel_size, strategy="PACK")
              for _ in range(n)]
    replicas = [ReplicaHandle(i, None, group) for i, group in enumerate(groups)]
    try:
        ray.get([group.ready() for group in groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        _end(replicas)
        raise KvslimError(f"Ray could not place {n} replicas of {spec.tensor_parallel_size} "
                          f"rank(s) with {bundle} each within {PLACEMENT_TIMEOUT_S:.0f} s: the "
                          f"cluster has {ray.cluster_resources()}") from None
    actor = ray.remote(Replica)
    for replica in replicas:
        replica.actor = actor.options(
            num_cpus=spec.cpus_per_rank, num_gpus=spec.gpus_per_rank, max_restarts=-1,
            max_task_retries=0, max_concurrency=10_000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                replica.placement_group, placement_group_bundle_index=0),
        ).remote(replica.index, spec)
    return replicas


def _load(replicas: list[ReplicaHandle]) -> ReplicaFacts:
    """Every replica's model loaded (their facts agree: one model, one config)."""
    ray = import_ray()
    facts = []
    for replica in replicas:
        try:
            facts.append(ray.get(replica.actor.facts.remote()))
        except ray.exceptions.RayError as e:
            raise KvslimError(f"replica {replica.index} could not start: {first_line(e)}") \
                from None
    return facts[0]


def _end(replicas: list[ReplicaHandle]) -> None:
    ray = import_ray()
    from ray.util.placement_group import remove_placement_group
    for replica in replicas:
        if replica.actor is not None:
            try:
                ray.kill(replica.actor, no_restart=True)
            except Exception:                        # noqa: BLE001 - already gone
                pass
        try:
            remove_placement_group(replica.placement_group)
        except Exception:                            # noqa: BLE001 - already gone
            pass
