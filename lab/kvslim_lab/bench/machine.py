"""What machine a benchmark ran on, and how fast its memory is (a STREAM-like measurement)."""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class MachineInfo:
    cpu: str
    cores: int
    memory_gib: float
    torch: str
    torch_threads: int
    device: str
    python: str

    def to_dict(self) -> dict:
        return asdict(self)


def machine_info(device: str = "cpu") -> MachineInfo:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return MachineInfo(cpu, os.cpu_count() or 0, round(mem, 1), torch.__version__,
                       torch.get_num_threads(), dev, platform.python_version())


@dataclass
class Bandwidth:
    read_gb_s: float        # summing a large float32 tensor: bytes read / s
    copy_gb_s: float        # copying it: bytes read + written / s
    size_mb: int


def memory_bandwidth(size_mb: int = 512, repeats: int = 5, device: str = "cpu") -> Bandwidth:
    """Best of `repeats` over a buffer much larger than the caches."""
    n = size_mb * 2**20 // 4
    a = torch.rand(n, device=device)
    b = torch.empty_like(a)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    read = best(lambda: a.sum())
    copy = best(lambda: b.copy_(a))
    nbytes = n * 4
    return Bandwidth(round(nbytes / read / 1e9, 2), round(2 * nbytes / copy / 1e9, 2), size_mb)
