"""What every tensor-parallel rank runs, rank 0 (inside the engine, `parallel_executor.py`) and
the workers alike: join the process groups, load and shard the model, agree on the KV cache,
and, on the workers, follow rank 0's steps.

Two process groups, because the model's collectives and the steps wait differently:

- the default group (gloo on the CPU, NCCL on CUDA) carries the model's collectives, with
  `EngineConfig.distributed_timeout`: a rank that dies or hangs mid-step fails the step within
  that time instead of stalling the others forever;
- a gloo group for Python objects (start-up exchanges and the steps). A process group's
  timeout is each process's own: the workers' is days, as they wait in it for the next step
  for as long as the engine idles (a server without requests); rank 0's is
  distributed_timeout, so that a worker that hangs (not one that dies: its closed connection
  fails rank 0's collective at once) fails rank 0's next broadcast instead of stalling it.
  Object collectives on NCCL would copy every pickle through the GPU.

Start-up, in the same order on every rank:

1. `load_shard`: the full model loaded, sharded, prepared, before the ranks meet, so that rank
   0 loads while the workers it spawned are still importing torch. Spawned workers then tell
   rank 0 through a pipe (`worker_main`), and rank 0 joins the group once all have; under
   torchrun the rendezvous waits, so distributed_timeout bounds how much later than the
   first rank the last may finish loading;
2. `join_group`, then (collectives of the object group, `start_rank`) rank 0's EngineConfig
   for the runners (under torchrun each rank parsed its own command line: rank 0's counts, and
   the KV caches are compared below) and which ranks failed to load and why, so that one rank
   that cannot load stops all of them with its message instead of leaving them waiting;
3. rank 0 broadcasts the max_model_len and EOS ids its engine derived (`WorkerSetup`), each
   worker builds its ModelRunner, and all gather every rank's KV-cache sizes (`RankKVStats`).

Then `follow`: per step, rank 0's `WorkerStep` (the SchedulerOutput, its sequences trimmed to what
the runner reads), the released rows first, then the same forward as rank 0 without sampling.
`None` in place of a setup or a step means stop."""
from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvslim.device import resolve_device
from kvslim.engine.config import EngineConfig
from kvslim.engine.model_runner import ModelRunner, kv_cache_plan_of
from kvslim.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvslim.engine.sequence import Sequence
from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model, resolve_dtype
from kvslim.kernels.activations import linear_activations
from kvslim.models.config import ModelConfig
from kvslim.parallel import shard_model

OBJECT_GROUP_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class WorkerSetup:
    max_model_len: int
    eos_token_ids: list[int]


@dataclass
class WorkerStep:
    released_seq_ids: list[int]        # since the last step (empty steps release rows too)
    out: SchedulerOutput


@dataclass
class RankGroup:
    """This process's place among the ranks: rank, device, and the object group."""
    rank: int
    world_size: int
    device: torch.device
    objects: Any = field(repr=False)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, by rank."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.objects)
        return out

    @staticmethod
    def close() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_device(device: str, local_rank: int) -> torch.device:
    """The configured device; on CUDA each rank of a machine takes its own (cuda:local_rank)."""
    resolved = resolve_device(device)
    return torch.device("cuda", local_rank) if resolved.type == "cuda" else resolved


def join_group(rank: int, world_size: int, init_method: str, config: EngineConfig,
               device: torch.device) -> RankGroup:
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    timeout = datetime.timedelta(seconds=config.distributed_timeout)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        objects = dist.new_group(backend="gloo",
                                 timeout=timeout if rank == 0 else OBJECT_GROUP_TIMEOUT)
    except BaseException:
        RankGroup.close()
        raise
    return RankGroup(rank, world_size, device, objects)


def load_shard(model_dir, config: EngineConfig, rank: int, world_size: int,
               device: torch.device) -> torch.nn.Module:
    """This rank's shard, ready for inference. The full model is loaded on the CPU, so that a
    GPU only ever holds its shard, and sharded before `prepare_for_inference` (whose packed
    kernels would hold the full weights)."""
    dtype = resolve_dtype(config.dtype, ModelConfig.from_dir(model_dir), device)
    model = load_model(model_dir, dtype=dtype, device="cpu")
    shard_model(model, rank, world_size)
    model.to(device)
    with linear_activations(config.linear_activations):
        model.prepare_for_inference()
    return model


def start_rank(rank: int, world_size: int, init_method: str, model_dir, config: EngineConfig,
               local_rank: int, loaded: Callable[[], None] | None = None
               ) -> tuple[RankGroup, EngineConfig, torch.nn.Module | None, Exception | None]:
    """Steps 1 and 2: this rank's group, rank 0's config, this rank's shard, and what to raise
    when any rank failed to load (every rank then stops): the failed rank its own error, the
    others a KvslimError naming the first rank that failed. The caller closes the group.
    `loaded` runs between loading (done or failed) and joining the group."""
    device = rank_device(config.device, local_rank)
    model, error = None, None
    try:
        model = load_shard(model_dir, config, rank, world_size, device)
    except Exception as e:                           # noqa: BLE001 - every rank must hear of it
        error = e
    if loaded is not None:
        loaded()
    group = join_group(rank, world_size, init_method, config, device)
    try:
        config = group.broadcast(config if rank == 0 else None)
        reports = group.gather(None if error is None else _describe(error))
    except BaseException:
        group.close()
        raise
    failed = [(r, message) for r, message in enumerate(reports) if message is not None]
    if failed and error is None:
        r, message = failed[0]
        error = KvslimError(f"tensor-parallel rank {r} could not load the model: {message}")
    return group, config, model, error


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, KvslimError) else f"{type(error).__name__}: {error}"


def worker_step(out: SchedulerOutput, released_seq_ids: list[int]) -> WorkerStep:
    """The step as the workers need it. Each sequence is a shallow copy, pickled at once (before
    rank 0's own runner runs it): every rank syncs its block tables from the same entries'
    `table_changes`, and every worker's tables went through the same syncs, so each rank
    copies the same entries. Of its tokens only the step's go (`TokenWindow`), not the whole context; left
    out too: what only rank 0 reads (prefix-cache hashes, output logprobs); the prompt logprobs
    become placeholders of the same length, as the runner only counts them."""
    scheduled = [dataclasses.replace(entry, seq=_lean(entry)) for entry in out.scheduled]
    return WorkerStep(list(released_seq_ids), SchedulerOutput(scheduled))


def _lean(entry: ScheduledSequence) -> Sequence:
    seq = entry.seq
    lean = copy.copy(seq)
    # the step's inputs, and the next token: the target of the last prompt logprob it scores
    lean.token_ids = TokenWindow(seq.token_ids, entry.start, entry.num_tokens + 1)
    lean.block_hashes, lean.logprobs = [], []
    lean.prompt_logprobs = [None] * len(seq.prompt_logprobs)
    return lean


class TokenWindow:
    """tokens[offset:offset + size] of a sequence's token list, indexed like the whole list
    (len() is the whole length). A read outside the window raises IndexError: a runner change
    that needs more of the context on the workers fails loudly, not with wrong tokens."""
    __slots__ = ("offset", "tokens", "length")

    def __init__(self, tokens: list[int], offset: int, size: int):
        self.offset, self.tokens, self.length = offset, tokens[offset:offset + size], len(tokens)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, stride = key.indices(self.length)
            if start >= stop:
                return []
            if stride != 1 or start < self.offset or stop > self.offset + len(self.tokens):
                raise IndexError(f"tokens {start}:{stop} are outside the step's window")
            return self.tokens[start - self.offset:stop - self.offset]
        index = key + self.length if key < 0 else key
        if not self.offset <= index < self.offset + len(self.tokens):
            raise IndexError(f"token {key} is outside the step's window")
        return self.tokens[index - self.offset]

    def __getstate__(self):
        return self.offset, self.tokens, self.length

    def __setstate__(self, state) -> None:
        self.offset, self.tokens, self.length = state


def follow(group: RankGroup, model: torch.nn.Module, config: EngineConfig) -> None:
    """A worker's step 3 and its loop, until rank 0 sends None."""
    setup = group.broadcast()
    if setup is None:
        return
    plan = kv_cache_plan_of(model, config, max_model_len=setup.max_model_len)
    runner = ModelRunner(model, config, setup.eos_token_ids, plan)
    group.gather(runner.kv_stats(group.rank))
    while (step := group.broadcast()) is not None:
        runner.release(step.released_seq_ids)
        runner.execute(step.out, sample=False)


def serve_rank(rank: int, world_size: int, init_method: str, model_dir, config: EngineConfig,
               local_rank: int, loaded: Callable[[], None] | None = None) -> None:
    """All a worker does, from loading its shard to rank 0's stop."""
    group, config, model, failure = start_rank(rank, world_size, init_method, model_dir,
                                               config, local_rank, loaded)
    try:
        if failure is not None:
            raise failure
        follow(group, model, config)
    finally:
        group.close()


def worker_main(rank: int, world_size: int, init_method: str, model_dir: str,
                config: EngineConfig, parent_pid: int, threads: int, ready) -> None:
    """A worker process started by the engine (multiprocessing spawn). It tells rank 0 through
    `ready` (a pipe) when it has loaded, so that rank 0 waits for the group only once every
    worker is past starting (one that dies before is noticed at once, not after a timeout).
    SIGINT is ignored: a Ctrl-C reaches the whole process group, and rank 0 decides when the
    workers stop. A worker whose engine died without stopping it (SIGKILL) exits by itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    _exit_with_parent(parent_pid)

    def loaded() -> None:
        ready.send(True)
        ready.close()

    try:
        serve_rank(rank, world_size, init_method, model_dir, config, rank, loaded)
    except KvslimError:
        sys.exit(2)                                  # rank 0 reports the error, in one line


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="kvslim-tp-parent", daemon=True).start()
