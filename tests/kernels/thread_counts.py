"""Shared by the kernel tests: a kernel's outputs at one and at two torch threads."""
import torch


def outputs_at_thread_counts(run, counts=(1, 2)) -> list[torch.Tensor]:
    """`run()` at each thread count, the caller's count restored afterwards."""
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in counts:
            torch.set_num_threads(threads)
            outs.append(run())
    finally:
        torch.set_num_threads(before)
    return outs
