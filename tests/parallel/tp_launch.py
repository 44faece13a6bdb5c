"""Run a function on N gloo ranks in spawned processes, for the tensor-parallel tests.

Each rank joins a process group rendezvousing through a file in the test's own temporary
directory (no port to pick, nothing shared between tests), runs `fn(rank, world_size, *args)`
with one thread (the ranks share the machine's cores) and hands its return value back through
a file. The parent never leaves a rank behind: a rank that fails makes torch terminate the
others, and a run past `timeout` (a rank stuck in a collective) is killed."""
from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _rank_main(rank: int, world_size: int, workdir: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(workdir) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, workdir: Path, *args, timeout: float = 180.0) -> list:
    """[fn's return value on rank 0, 1, ...]; a rank's exception is raised here (as
    torch.multiprocessing's ProcessRaisedException, with the rank's traceback)."""
    workdir.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(_rank_main, args=(world_size, str(workdir), fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks still running after {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(workdir / f"result{r}.pt") for r in range(world_size)]


def launched_once_per_degree(fn, cases, mktemp):
    """world_size -> `run_ranks(fn, world_size, ...)` over `cases(world_size)`, each degree
    launched once, on first use, for a module's tests to share (starting the ranks costs more
    than the small models they run)."""
    cache = {}

    def get(world_size: int) -> list:
        if world_size not in cache:
            cache[world_size] = run_ranks(fn, world_size, mktemp(f"tp{world_size}"),
                                          cases(world_size))
        return cache[world_size]
    return get
