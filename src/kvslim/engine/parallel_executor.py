"""`TensorParallelExecutor`: the engine's side of tensor parallelism (vLLM's driver-worker design).

The engine process is rank 0. It loads, shards and runs its own shard, keeps the scheduler, the
block manager and the sampler, and drives N - 1 workers (`parallel_worker.py`): before its own
forward of each step it broadcasts the step, and every rank then runs the same ModelRunner
forward in lockstep (the collectives are inside the sharded model, `kvslim.parallel`). Every
rank ends the step with the same full logits, so only rank 0 samples and nothing comes back.
Each rank's paged cache holds its own KV heads, sized by kv_cache_memory (per rank) from its
shard's config; all ranks have the same number of blocks (checked at start-up), so rank 0's
block manager is every rank's.

`start` launches the ranks in one of two ways:

- one machine (default): the workers are spawned here (torch.multiprocessing, spawn), and the
  ranks meet through a file in a private temporary directory. Each rank gets
  torch.get_num_threads() // N threads, rank 0 included (restored at shutdown). A script
  that builds the engine needs the usual `if __name__ == "__main__":` guard, as for any spawn.
- several machines: `torchrun ... -m kvslim.cli.main serve ... --tensor-parallel-size N`
  (RANK and WORLD_SIZE set): nothing is spawned and the ranks meet through env://. Rank 0 runs
  the command; on the other ranks `start` never returns: they serve rank 0's steps and leave
  with SystemExit(0) when rank 0 shuts down.

One tensor-parallel engine per process: torch.distributed's default group is global.

Failure. `execute` checks that every worker is alive before it starts a step; a worker that dies
mid-step fails rank 0's collective at once (gloo sees its connection close), one that hangs
fails it after distributed_timeout. Either way `execute` raises (naming a dead rank and its
signal), the engine raises EngineFailedError, and `shutdown` ends the workers: with a stop
message when they are waiting for the next step, else (mid-step, state unknown) with SIGTERM,
then SIGKILL. `shutdown` is idempotent, and the engine also runs it when it is
garbage-collected or the interpreter exits. A worker whose engine process was killed exits by
itself (`parallel_worker.worker_main`).

CUDA (NCCL for the model's collectives, one device per rank, no CUDA graphs) follows the same
code but is untested here; there NCCL's own watchdog, not an exception, handles a collective
that times out."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvslim.engine.config import EngineConfig
from kvslim.engine.model_runner import ModelRunner
from kvslim.engine.outputs import RankKVStats
from kvslim.engine.parallel_worker import (RankGroup, WorkerSetup,
                                           rank_device, serve_rank, start_rank, worker_main,
                                           worker_step)
from kvslim.engine.scheduler import SchedulerOutput
from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig
from kvslim.parallel import rank_layout

STOP_GRACE_S = 10.0                   # for workers to leave after the stop message
# A killed rank's sockets close before the kernel reports its exit: on a loaded machine the
# peers' collectives fail a second or more before the parent can reap it.
REAP_WAIT_S = 10.0


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun (or any env:// launcher) tells this process."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launch_env() -> LaunchEnv | None:
    """torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, or None when not launched so."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise KvslimError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be "
                          "integers") from None
    return LaunchEnv(rank, world, local_rank, local_world)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                           # not on Linux
        return os.cpu_count() or 1


def check_tensor_parallel(model_config: ModelConfig, config: EngineConfig) -> None:
    """What can be refused before any weights load or any rank starts, in one line each: a
    degree the model cannot be split by (`parallel.sharding`), a torchrun world of another
    size, more ranks on this machine than CPU cores (without tensor_parallel_oversubscribe) or
    CUDA devices."""
    n = config.tensor_parallel_size
    if n == 1:
        return
    rank_layout(model_config, 0, n)
    env = launch_env()
    if env is not None and env.world_size != n:
        raise KvslimError(f"tensor_parallel_size is {n} but the launcher started "
                          f"WORLD_SIZE={env.world_size} processes")
    local = env.local_world_size if env is not None else n
    device = rank_device(config.device, 0)
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if local > have:
            raise KvslimError(f"tensor_parallel_size {n} runs {local} ranks on this machine, "
                              f"one per CUDA device, but it has {have}")
    elif local > usable_cores() and not config.tensor_parallel_oversubscribe:
        raise KvslimError(f"tensor_parallel_size {n} runs {local} ranks on this machine, which "
                          f"has {usable_cores()} CPU cores; pass --tensor-parallel-oversubscribe "
                          f"(tensor_parallel_oversubscribe=True) to share cores")


class TensorParallelExecutor:
    """`execute` and `release` as ModelRunner's, for the engine; `model` is rank 0's shard."""

    def __init__(self, processes: list, workdir: str | None, threads_before: int | None):
        self.processes = processes                   # spawned workers (none under torchrun)
        self.workdir = workdir
        self.threads_before = threads_before
        self.group: RankGroup | None = None
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self._released: list[int] = []
        self._kv_stats: list[RankKVStats] = []
        self._ready: list = []        # per spawned worker, the pipe it reports loading through
        self._listening = False       # the workers wait for a broadcast: a stop message works
        self._leaving = False         # the workers stop by themselves (start-up failed)
        self._stopped = False

    # ---- start-up ------------------------------------------------------------------------
    @classmethod
    def start(cls, model_dir, config: EngineConfig) -> "TensorParallelExecutor":
        """Every rank started and rank 0's shard loaded (all ranks loaded theirs). Under
        torchrun, on ranks > 0 this serves rank 0 and raises SystemExit(0) when it is done."""
        n = config.tensor_parallel_size
        check_tensor_parallel(ModelConfig.from_dir(model_dir), config)
        if dist.is_available() and dist.is_initialized():
            raise KvslimError("this process already has a torch.distributed process group (is "
                              "another tensor-parallel engine running?); shut it down first")
        env = launch_env()
        if env is not None and env.rank > 0:
            serve_rank(env.rank, n, "env://", model_dir, config, env.local_rank)
            raise SystemExit(0)
        if env is not None:
            executor, init_method, local_rank = cls([], None, None), "env://", env.local_rank
        else:
            executor, init_method = cls._spawn(model_dir, config)
            local_rank = 0
        try:
            executor.group, _, executor.model, failure = start_rank(
                0, n, init_method, model_dir, config, local_rank, executor._await_workers)
        except BaseException:
            executor.shutdown()
            raise
        if failure is not None:
            executor._leaving = True                 # every rank knows: the workers exit
            executor.shutdown()
            raise failure
        executor._listening = True
        return executor

    @classmethod
    def _spawn(cls, model_dir, config: EngineConfig) -> tuple["TensorParallelExecutor", str]:
        n = config.tensor_parallel_size
        workdir = tempfile.mkdtemp(prefix="kvslim-tp-")
        init_method = f"file://{workdir}/rendezvous"
        threads_before = torch.get_num_threads()
        threads = max(1, threads_before // n)
        context = mp.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, n)]
        processes = [context.Process(
            target=worker_main, name=f"kvslim-tp-rank{rank}", daemon=True,
            args=(rank, n, init_method, str(model_dir), config, os.getpid(), threads, sender))
            for rank, (_, sender) in enumerate(pipes, start=1)]
        executor = cls(processes, workdir, threads_before)
        executor._ready = [receiver for receiver, _ in pipes]
        torch.set_num_threads(threads)
        try:
            for process, (_, sender) in zip(processes, pipes):
                process.start()
                sender.close()                       # the worker's now: EOF if it dies
        except BaseException:
            executor.shutdown()
            raise
        return executor, init_method

    def _await_workers(self) -> None:
        """Until every spawned worker has loaded its shard (or failed to, which the ranks then
        share); a worker that exits before is reported at once."""
        pending = dict(zip(self._ready, enumerate(self.processes, start=1)))
        while pending:
            for receiver in wait(list(pending)):
                rank, process = pending.pop(receiver)
                try:
                    receiver.recv()
                except EOFError:
                    process.join(5.0)
                    raise KvslimError(
                        f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                        f"{process.exitcode} while starting; its error is printed above (a "
                        f"script that starts the engine needs if __name__ == '__main__':)"
                    ) from None

    def attach(self, runner: ModelRunner, max_model_len: int, eos_token_ids: list[int]
               ) -> "TensorParallelExecutor":
        """Step 3 (`parallel_worker`): the workers build their runners from rank 0's limits;
        their KV caches must match rank 0's, which the block manager sizes."""
        self.runner = runner
        self._listening = False
        self.group.broadcast(WorkerSetup(max_model_len, list(eos_token_ids)))
        self._kv_stats = self.group.gather(runner.kv_stats(0))
        self._listening = True
        shapes = {(s.num_blocks, s.bytes_per_block) for s in self._kv_stats}
        if len(shapes) != 1:
            raise KvslimError("the tensor-parallel ranks' KV caches differ (blocks, bytes per "
                              f"block by rank: {sorted(shapes)}); give every rank the same "
                              "kv_cache_memory and model")
        return self

    # ---- steps ---------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, draft_probs=None) -> dict:
        self.check_alive()
        step = worker_step(out, self._released)
        self._released = []
        self._listening = False
        try:
            self.group.broadcast(step)
            results = self.runner.execute(out, draft_probs)
        except Exception as e:
            dead = self._dead_rank(wait_s=REAP_WAIT_S)     # a collective failed: was it a dead rank?
            if dead is not None:
                raise RuntimeError(dead) from e
            raise
        self._listening = True
        return results

    def release(self, seq_ids: list[int]) -> None:
        """Rank 0's rows now; the workers' with the next step (the same order on every rank)."""
        self.runner.release(seq_ids)
        self._released.extend(seq_ids)

    def check_alive(self) -> None:
        if self._stopped:
            raise RuntimeError("the tensor-parallel ranks have been shut down")
        dead = self._dead_rank()
        if dead is not None:
            raise RuntimeError(dead)

    def _dead_rank(self, wait_s: float = 0.0) -> str | None:
        """What ended the first spawned worker that is no longer running, if one is not; a
        rank that just died may need up to `wait_s` to be seen dead (polled: on CI a failed
        collective once found every worker's sentinel quiet although one had been killed)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                how = _how_it_ended(process)
                if how is not None:
                    return f"tensor-parallel rank {rank} (pid {process.pid}) {how}"
            if time.monotonic() >= deadline or not self.processes:
                return None
            wait([p.sentinel for p in self.processes], timeout=0.05)

    def rank_kv_stats(self) -> list[RankKVStats]:
        return list(self._kv_stats)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ---- the end -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every rank this process started (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        clean = self._listening and all(p.is_alive() for p in self.processes)
        if clean:
            try:
                self.group.broadcast(None)
            except Exception:                        # noqa: BLE001 - ended below instead
                clean = False
        _end_processes(self.processes, STOP_GRACE_S if clean or self._leaving else 0.0)
        try:
            RankGroup.close()
        except Exception:                            # noqa: BLE001 - the ranks are gone
            pass
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)


def _how_it_ended(process) -> str | None:
    """None while `process` runs; else how it ended. Its exit status comes from
    multiprocessing, or, when something else in this process collected it first (then
    multiprocessing thinks it runs forever), from its absence in /proc."""
    if process.is_alive() and (not os.path.isdir("/proc")
                               or os.path.exists(f"/proc/{process.pid}")):
        return None
    code = process.exitcode
    if code is None:
        return "is gone (its exit status was collected elsewhere)"
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else \
        f"exited with code {code}"


def _end_processes(processes: list, grace_s: float) -> None:
    """Wait `grace_s` for each to leave, then SIGTERM, then SIGKILL; none is left running."""
    for process in processes:
        if process.pid is not None:
            process.join(grace_s)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        if process.pid is None:
            continue
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
