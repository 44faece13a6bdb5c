"""A replica's tensor-parallel ranks across Ray workers (and so across machines).

The ranks are the ones `kvslim serve --tensor-parallel-size N` runs (engine/parallel_executor.py
and parallel_worker.py): rank 0 inside the engine, ranks 1..N-1 following its steps. Only the
launch and the rendezvous differ. The pool reserves one bundle per rank in a placement group
(pool.py); the replica's actor, in bundle 0, is rank 0; it starts a `RankWorker` actor in each
other bundle, on whichever machine Ray placed it, and the ranks meet through env:// at rank 0's
address, as under torchrun: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in rank 0's environment
make the engine take the launcher's path (`launch_env`), and each worker calls `serve_rank`
itself. torch.distributed then runs gloo on the CPU, NCCL on CUDA (each rank's actor sees the
one GPU Ray gave it, hence LOCAL_RANK 0).

The workers are owned by rank 0's actor: if it dies they die with it, and when Ray restarts it
its constructor starts new ones. A worker that dies fails rank 0's next collective, its engine
thread dies, and the replica's process exits so that Ray restarts all of it (replica.py)."""
from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass

import torch

from kvslim.engine.config import EngineConfig
from kvslim.engine.parallel_worker import serve_rank
from kvslim.errors import KvslimError
from kvslim.formats.registry import engine_model_dir
from kvslim.scaleout.ray_runtime import import_ray

STOP_GRACE_S = 10.0                   # for the workers to leave after rank 0's stop message


class RankWorker:
    """A tensor-parallel rank > 0: the class of a Ray actor in its bundle."""

    def __init__(self, threads: int):
        torch.set_num_threads(threads)

    def serve(self, rank: int, world_size: int, address: str, port: int, model: str | None,
              engine_options: dict) -> None:
        """Load this rank's shard, meet the others at rank 0's address, follow rank 0's steps
        until it stops."""
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
        config = EngineConfig.from_options(**engine_options)
        serve_rank(rank, world_size, "env://", engine_model_dir(model, config.dtype), config,
                   local_rank=0)


@dataclass
class RankLauncher:
    workers: list                     # RankWorker actors, rank 1 first
    calls: list                       # their `serve` calls, done when they have left

    @classmethod
    def start(cls, spec) -> "RankLauncher":
        """Ranks 1..N-1 started in this actor's placement group, and this process set up as
        rank 0 (its engine then meets them while it loads)."""
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        group = ray.util.get_current_placement_group()
        n = spec.tensor_parallel_size
        if group is None or group.bundle_count < n:
            raise KvslimError(f"a replica of {n} tensor-parallel ranks needs a placement group "
                              f"of {n} bundles")
        address, port = ray.util.get_node_ip_address(), free_port()
        os.environ.update(RANK="0", WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=address, MASTER_PORT=str(port))
        actor = ray.remote(RankWorker)
        workers = [actor.options(
            num_cpus=spec.cpus_per_rank, num_gpus=spec.gpus_per_rank, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)).remote(spec.threads)
            for rank in range(1, n)]
        calls = [worker.serve.remote(rank, n, address, port, spec.model, spec.engine_options)
                 for rank, worker in enumerate(workers, start=1)]
        return cls(workers, calls)

    async def leave(self) -> None:
        """After rank 0's engine shut down (its stop message sent): the workers leave, and
        are killed if they do not."""
        try:
            await asyncio.wait_for(asyncio.gather(*self.calls), STOP_GRACE_S)
        except Exception:                            # noqa: BLE001 - killed below anyway
            pass
        self.kill()

    def kill(self) -> None:
        ray = import_ray()
        for worker in self.workers:
            ray.kill(worker)


def free_port() -> int:
    """A port free on this machine now, for rank 0's rendezvous (another process could take it
    before the store binds it; the start then fails and Ray restarts the replica)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
