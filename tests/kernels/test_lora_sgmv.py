"""Many LoRA adapters in one batch (kernels/lora_sgmv.py): the kernel and its torch fallback
against a float64 row-by-row reference, rows without an adapter left with their bits, every
row's bits independent of the batch, its order and the threads, and the refusals."""
import pytest
import torch

from kvslim.kernels import extension, lora_sgmv
from thread_counts import outputs_at_thread_counts

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")

# (in, R, shard_rows): a fused q/k/v with a narrow k and v, a gate/up pair, a larger model's
# q/k/v, and odd sizes (tails of the 16-lane sums, an empty shard, a block across shards).
SHAPES = [(576, 16, (64, 16, 16)), (1536, 8, (96, 96)), (576, 16, (576, 192, 192)),
          (1536, 16, (128, 32, 32)), (37, 24, (7, 0, 9)), (100, 8, (20, 13))]


@pytest.fixture(scope="module")
def kernel():
    assert lora_sgmv.available(), extension.load()
    return torch.ops.kvslim.lora_add_


def problem(rows, inner, rank, shard_rows, slots=4, seed=0):
    """y, x, slots (about one row in five without an adapter), a, b."""
    g = torch.Generator().manual_seed(seed)
    out = sum(shard_rows)
    a = torch.randn(slots, len(shard_rows) * rank, inner, generator=g) / inner ** 0.5
    b = torch.randn(slots, out, rank, generator=g) / rank ** 0.5
    x, y = torch.randn(rows, inner, generator=g), torch.randn(rows, out, generator=g)
    chosen = torch.randint(-1, slots, (rows,), generator=g)
    chosen[torch.rand(rows, generator=g) < 0.1] = -1
    return y, x, chosen, a, b


def row_by_row(y, x, slots, a, b, shard_rows):
    """The definition, one row and one shard at a time, in float64."""
    y = y.double().clone()
    rank = b.shape[2]
    starts = [sum(shard_rows[:j]) for j in range(len(shard_rows))]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        u = a[s].double() @ x[t].double()
        for j, (o0, rows) in enumerate(zip(starts, shard_rows)):
            y[t, o0:o0 + rows] += b[s, o0:o0 + rows].double() @ u[j * rank:(j + 1) * rank]
    return y


def run(op, y, x, slots, a, b, shard_rows):
    y = y.clone()
    op(y, x, slots, a, b, list(shard_rows))
    return y


@pytest.mark.parametrize("inner,rank,shard_rows", SHAPES)
def test_the_kernel_and_the_fallback_match_the_definition(kernel, inner, rank, shard_rows):
    y, x, slots, a, b = problem(23, inner, rank, shard_rows)
    want = row_by_row(y, x, slots, a, b, shard_rows)
    got = run(kernel, y, x, slots, a, b, shard_rows)
    fallback = run(lora_sgmv.lora_add_reference, y, x, slots, a, b, shard_rows)
    exact = run(lora_sgmv.lora_add_reference, y.double(), x.double(), slots, a.double(),
                b.double(), shard_rows)
    scale = want.abs().max()
    assert (got.double() - want).abs().max() / scale < 1e-6
    assert (fallback.double() - want).abs().max() / scale < 1e-6
    assert (exact - want).abs().max() / scale < 1e-12
    assert (got - fallback).abs().max() / scale < 1e-6
    idle = slots < 0
    assert idle.any() and (~idle).any()
    for out in (got, fallback):
        assert torch.equal(out[idle], y[idle])          # untouched: the same bits


def test_the_fallback_in_chunks_of_rows(monkeypatch):
    y, x, slots, a, b = problem(11, 100, 8, (20, 13))
    monkeypatch.setattr(lora_sgmv, "CHUNK_ELEMENTS", 3 * (16 * 100 + 33 * 8))   # 3 rows a chunk
    got = run(lora_sgmv.lora_add_reference, y.double(), x.double(), slots, a.double(),
              b.double(), (20, 13))
    assert (got - row_by_row(y, x, slots, a, b, (20, 13))).abs().max() < 1e-12


def test_the_wrapper_takes_the_kernel_on_cpu_float32_else_the_fallback(kernel):
    y, x, slots, a, b = problem(9, 576, 16, (64, 16, 16))
    assert lora_sgmv.usable(x) and not lora_sgmv.usable(x.double())
    got = y.clone()
    lora_sgmv.lora_add_(got, x, slots, a, b, (64, 16, 16))
    assert torch.equal(got, run(kernel, y, x, slots, a, b, (64, 16, 16)))
    wide = y.double()
    lora_sgmv.lora_add_(wide, x.double(), slots, a.double(), b.double(), (64, 16, 16))
    assert (wide - row_by_row(y, x, slots, a, b, (64, 16, 16))).abs().max() < 1e-12


@pytest.mark.parametrize("inner,rank,shard_rows", SHAPES[:4])
def test_a_rows_bits_do_not_depend_on_the_batch_or_its_order(kernel, inner, rank, shard_rows):
    y, x, slots, a, b = problem(64, inner, rank, shard_rows, slots=8, seed=1)
    alone = torch.cat([run(kernel, y[t:t + 1], x[t:t + 1], slots[t:t + 1], a, b, shard_rows)
                       for t in range(64)])
    g = torch.Generator().manual_seed(2)
    for rows in range(1, 65):
        pick = torch.randperm(64, generator=g)[:rows]
        got = run(kernel, y[pick], x[pick], slots[pick], a, b, shard_rows)
        assert torch.equal(got, alone[pick]), rows
    one_slot = torch.zeros_like(slots)                 # the same rows, all through slot 0
    alone0 = torch.cat([run(kernel, y[t:t + 1], x[t:t + 1], one_slot[:1], a, b, shard_rows)
                        for t in range(64)])
    assert torch.equal(run(kernel, y, x, one_slot, a, b, shard_rows), alone0)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_threads_do_not_change_the_bits(kernel, rows):
    y, x, slots, a, b = problem(rows, 1536, 16, (128, 32, 32), slots=8, seed=3)
    one, two = outputs_at_thread_counts(lambda: run(kernel, y, x, slots, a, b, (128, 32, 32)))
    assert torch.equal(one, two)


def test_no_adapter_at_all_leaves_y_alone(kernel):
    y, x, slots, a, b = problem(7, 576, 8, (96, 96))
    got = run(kernel, y, x, torch.full_like(slots, -1), a, b, (96, 96))
    assert torch.equal(got, y)
    empty = torch.empty(0, 192)
    kernel(empty, x[:0], slots[:0], a, b, [96, 96])


def test_refusals(kernel):
    y, x, slots, a, b = problem(4, 64, 8, (32, 16), slots=3)
    bad = {
        "must be float32": (y, x.double(), slots, a, b, [32, 16]),
        "slots must be int64": (y, x, slots.int(), a, b, [32, 16]),
        r"slot 3 of row 1 is out of range \[-1, 3\)": (y, x, torch.tensor([0, 3, 0, 0]), a, b,
                                                        [32, 16]),
        r"slot -2 of row 0": (y, x, torch.tensor([-2, 0, 0, 0]), a, b, [32, 16]),
        r"shard_rows \[32, 8\] sum to 40, not y's 48 outputs": (y, x, slots, a, b, [32, 8]),
        r"a must be \[S, n\*R, in\]": (y, x, slots, a, b, [16, 16, 16]),
        "must be contiguous": (y, x, slots, a.transpose(1, 2).contiguous().transpose(1, 2), b,
                               [32, 16]),
        "same rows": (y[:3], x, slots, a, b, [32, 16]),
        r"b must be \[S, out, R\]": (y, x, slots, a, b[:2], [32, 16]),
    }
    for message, args in bad.items():
        before = args[0].clone()
        with pytest.raises(RuntimeError, match=message):
            kernel(*args)
        assert torch.equal(args[0], before), message
    with pytest.raises(ValueError, match="shard_rows"):
        lora_sgmv.lora_add_reference(y.double(), x.double(), slots, a.double(), b.double(),
                                     [32, 8])
