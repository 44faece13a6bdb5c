"""The extension's cache write: the same bytes as indexing for every cache dtype, negative slots
as Python counts them, clear errors for slots outside the cache and mismatched dtypes, and an
in-place write inside a compiled function."""
import pytest
import torch

from kvslim.attention.kv_cache import slot_writer, store_slots
from kvslim.kernels import extension, store_slots as slot_kernel

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert slot_kernel.available(), extension.load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_it_writes_what_indexing_writes(dtype):
    g = torch.Generator().manual_seed(0)
    cache = (torch.randn(5, 4, 3, 8, generator=g) * 50).to(dtype)
    values = (torch.randn(6, 3, 8, generator=g) * 50).to(dtype)
    slots = torch.tensor([0, 7, 19, 3, -1, 12])
    want = cache.clone()
    store_slots(want, slots, values)
    torch.ops.kvslim.write_slots(cache, slots, values)
    assert torch.equal(cache, want)


def test_scales_of_one_value_per_slot_are_written_too():
    cache, values = torch.zeros(2, 4, 3, dtype=torch.float16), torch.ones(2, 3, dtype=torch.float16)
    torch.ops.kvslim.write_slots(cache, torch.tensor([1, 6]), values)
    assert cache.view(-1, 3)[[1, 6]].eq(1).all() and cache.sum() == 6


def test_bad_slots_and_dtypes_are_refused():
    cache = torch.zeros(2, 4, 3)
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache's 8 slots"):
        torch.ops.kvslim.write_slots(cache, torch.tensor([8]), torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="values are Half, the cache Float"):
        torch.ops.kvslim.write_slots(cache, torch.tensor([0]), torch.ones(1, 3).half())
    with pytest.raises(RuntimeError, match="2 slots of 3 elements, values hold 3"):
        torch.ops.kvslim.write_slots(cache, torch.tensor([0, 1]), torch.ones(1, 3))


def test_a_compiled_function_writes_the_cache_in_place():
    cache = torch.zeros(3, 2, 4)
    write = slot_writer(cache)
    assert write is torch.ops.kvslim.write_slots

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(cache, slots, values):
        write(cache, slots, values)
        return values.sum()

    step(cache, torch.tensor([4]), torch.full((1, 4), 2.0))
    assert cache.view(-1, 4)[4].eq(2).all() and cache.sum() == 8
