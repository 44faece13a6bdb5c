"""The scale-out flags of `kvslim serve`, one field each (cli/serve_cmds.py generates the flags
from these fields, as it does ServerOptions')."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvslim.errors import KvslimError
from kvslim.scaleout.router import ROUTING_POLICIES


def _option(default, help: str, choices: tuple | None = None, metavar: str | None = None):
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "metavar": metavar})


@dataclass
class ScaleOutOptions:
    data_parallel_size: int = _option(
        1, "engine replicas, each a Ray actor with its own KV cache, behind this one API "
        "server (more than 1 needs Ray: pip install 'kvslim[ray]')", metavar="N")
    ray_address: str | None = _option(
        None, "the Ray cluster the replicas run on: 'auto' (the one `ray start` runs on this "
        "machine), HOST:PORT, or 'local' (a new runtime, even for one replica); default: a "
        "local runtime started and stopped with the server when --data-parallel-size > 1",
        metavar="ADDR")
    routing: str = _option(
        "prefix", "which replica serves a request: the one whose prefix cache holds most of "
        "its prompt's blocks (else the least loaded), the least loaded, or each in turn",
        ROUTING_POLICIES)
    replica_cpus: float | None = _option(
        None, "CPUs Ray reserves for each rank of a replica, and its torch threads unless "
        "--threads is given (default: the CPUs of the local runtime, this machine's cores, or "
        "of the cluster, shared among all ranks)",
        metavar="CPUS")

    @property
    def uses_ray(self) -> bool:
        return self.data_parallel_size > 1 or self.ray_address is not None

    def check(self) -> None:
        """Each mistake in one line, before Ray or a model starts."""
        if self.data_parallel_size < 1:
            raise KvslimError(f"--data-parallel-size must be at least 1, got "
                              f"{self.data_parallel_size}")
        if self.replica_cpus is not None and not self.replica_cpus > 0:
            raise KvslimError(f"--replica-cpus must be positive, got {self.replica_cpus}")
        if self.ray_address is not None and not self.ray_address.strip():
            raise KvslimError("--ray-address is empty")
