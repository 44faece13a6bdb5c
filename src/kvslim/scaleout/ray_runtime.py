"""Ray for the replicas: imported only when they are asked for (it is an optional extra), and
a runtime to run them on: a cluster's, or a local one that this server starts and stops.

The local runtime declares this machine's cores (at least what the replicas reserve), keeps
its object store small (replicas exchange tokens, not tensors), starts no dashboard and sends
no usage statistics; `shutdown` ends every process it started."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from kvslim.errors import KvslimError

RAY_INSTALL = "pip install 'kvslim[ray]'"
# Ray's least; the default (30% of memory) would reserve gigabytes of /dev/shm for nothing.
LOCAL_OBJECT_STORE_BYTES = 128 * 1024 ** 2


def import_ray():
    """The ray module, or a one-line error that says how to install it."""
    try:
        import ray
    except ImportError:
        raise KvslimError(f"--data-parallel-size > 1 and --ray-address run replicas on Ray, "
                          f"which is not installed: {RAY_INSTALL}") from None
    return ray


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                           # not on Linux
        return os.cpu_count() or 1


@dataclass
class RayRuntime:
    owned: bool                       # started here: its processes end with the server
    address: str
    _stopped: bool = False

    def shutdown(self) -> None:
        """Disconnect; a runtime started here stops (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        ray = import_ray()
        if ray.is_initialized():
            ray.shutdown()


def start_runtime(address: str | None, num_cpus: float) -> RayRuntime:
    """Connect to the cluster at `address` ('auto', HOST:PORT, ray://...), or start a local
    runtime (None or 'local') declaring `num_cpus` CPUs."""
    ray = import_ray()
    if ray.is_initialized():
        raise KvslimError("this process is already connected to Ray; one replica pool per "
                          "process")
    owned = address is None or address == "local"
    kwargs = dict(include_dashboard=False, log_to_driver=True, configure_logging=False)
    if owned:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs.update(address="local", num_cpus=num_cpus,
                      object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    else:
        kwargs.update(address=address)
    where = "a local Ray runtime" if owned else f"the Ray cluster at {address}"
    try:
        context = ray.init(**kwargs)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise KvslimError(f"cannot start {where}: {first_line(e)}") from None
    print(f"kvslim serve: replicas on {where}", file=sys.stderr, flush=True)
    return RayRuntime(owned, getattr(context, "address_info", {}).get("address", address or ""))


def first_line(error: BaseException) -> str:
    """An error's message in one line: Ray's carry tracebacks, whose last line names the
    cause."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    causes = [line for line in lines if "Error:" in line and not line.startswith("File ")]
    return causes[-1] if causes else lines[0]
