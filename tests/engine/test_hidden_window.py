"""HiddenWindows: consecutive rows extend a sequence's window up to its size; rows that do not
continue it (skipped or repeated positions) replace it; pop forgets."""
import torch

from kvslim.engine.hidden_window import HiddenWindows


def rows(first: int, n: int) -> torch.Tensor:
    """Row i holds its position, so a window shows which positions it kept."""
    return torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, 2)


def test_consecutive_rows_extend_the_window_up_to_its_size():
    w = HiddenWindows(4)
    w.keep(7, 0, rows(0, 3))                   # a prefill chunk, positions 0..2
    w.keep(7, 3, rows(3, 2))                   # a verification's rows, 3..4
    got = w.get(7)
    assert (got.start, got.end) == (1, 4)
    assert got.rows[:, 0].tolist() == [1, 2, 3, 4]
    w.keep(7, 5, rows(5, 1))
    assert w.get(7).rows[:, 0].tolist() == [2, 3, 4, 5]


def test_rows_that_do_not_continue_replace_the_window():
    w = HiddenWindows(8)
    w.keep(1, 0, rows(0, 5))
    w.keep(1, 9, rows(9, 2))                   # positions 5..8 were a prefix-cache hit
    assert (w.get(1).start, w.get(1).end) == (9, 10)
    w.keep(1, 3, rows(3, 1))                   # a preempted sequence computing again
    assert (w.get(1).start, w.get(1).end) == (3, 3)
    w.keep(1, 4, rows(4, 0))                   # nothing new: nothing changes
    assert w.get(1).end == 3


def test_kept_rows_are_copies_and_pop_forgets():
    w = HiddenWindows(2)
    step = rows(0, 3).clone()
    w.keep(5, 0, step)
    step.zero_()                               # the step's buffer is reused afterwards
    assert w.get(5).rows[:, 0].tolist() == [1, 2]
    assert 5 in w and 6 not in w
    w.pop(5)
    w.pop(6)
    assert w.get(5) is None and not w.windows
