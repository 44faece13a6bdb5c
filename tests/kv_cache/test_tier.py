"""The KV tier's storage: a block round-trips through memory and disk bit for bit; a file from
another model, a torn or truncated one, a flipped byte or garbage is removed and never loaded;
a crash mid-write leaves no readable file; both levels drop the least recently used block
first; a second process sharing the directory finds what the first one wrote."""
import os

import pytest
import torch

from kvslim.kv_cache.tier import SUFFIX, KVTier, StoredBlock, decode, encode

ID = b"\1" * 32


def block(seed: int = 0, tokens=(1, 2, 3, 4)) -> StoredBlock:
    g = torch.Generator().manual_seed(seed)
    return StoredBlock(tuple(tokens), [torch.randn(2, 4, 2, 8, generator=g),
                                       torch.randn(2, 4, 2, 8, generator=g).half(),
                                       torch.randint(-128, 127, (2, 4, 2), generator=g, dtype=torch.int8)])


def same(a: StoredBlock, b: StoredBlock) -> bool:
    return a.tokens == b.tokens and all(x.dtype == y.dtype and torch.equal(x, y)
                                        for x, y in zip(a.tensors, b.tensors))


@pytest.mark.parametrize("memory", [0, 10**6])
def test_a_block_comes_back_bit_for_bit(tmp_path, memory):
    tier = KVTier(ID, tmp_path, memory_bytes=memory)
    key = tier.key((0, b"\2" * 32))
    tier.put(key, block())
    assert key in tier and same(tier.get(key), block())
    assert tier.stats.hits == 1 and tier.get("0" * 64) is None and tier.stats.misses == 1


def test_a_restart_finds_the_blocks_on_disk(tmp_path):
    first = KVTier(ID, tmp_path)
    keys = [first.key((0, bytes([i]) * 32)) for i in range(3)]
    for i, key in enumerate(keys):
        first.put(key, block(i))
    again = KVTier(ID, tmp_path)
    assert all(same(again.get(k), block(i)) for i, k in enumerate(keys))


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty", "foreign"])
def test_a_damaged_or_foreign_file_is_removed_not_loaded(tmp_path, damage):
    tier = KVTier(ID, tmp_path)
    key = tier.key((0, b"\3" * 32))
    tier.put(key, block())
    path = tmp_path / f"{key}{SUFFIX}"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[:len(data) - 9]
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "empty":
        data = bytearray()
    else:                                    # another model's block under this key's name
        data = bytearray(encode(b"\9" * 32, key, block()))
    path.write_bytes(bytes(data))
    reader = KVTier(ID, tmp_path)
    assert reader.get(key) is None and not path.exists() and reader.stats.rejected == 1
    assert decode(ID, key, bytes(data)) is None


def test_a_write_cut_short_leaves_nothing_readable(tmp_path, monkeypatch):
    tier = KVTier(ID, tmp_path)
    key = tier.key((0, b"\4" * 32))

    def crash(*args):
        raise OSError("power cut")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        tier.put(key, block())
    monkeypatch.undo()
    assert KVTier(ID, tmp_path).get(key) is None
    assert not list(tmp_path.glob(f"*{SUFFIX}"))


def test_both_levels_drop_the_least_recently_used_first(tmp_path):
    size = len(encode(ID, "k" * 64, block()))
    disk = KVTier(ID, tmp_path, max_disk_bytes=2 * size)
    keys = [disk.key((0, bytes([i]) * 32)) for i in range(3)]
    disk.put(keys[0], block(0))
    disk.put(keys[1], block(1))
    disk.get(keys[0])                                    # keys[1] is now the oldest use
    disk.put(keys[2], block(2))
    assert keys[1] not in disk and keys[0] in disk and keys[2] in disk
    memory = KVTier(ID, None, memory_bytes=2 * block().num_bytes)
    for i, key in enumerate(keys):
        memory.put(key, block(i))
    assert keys[0] not in memory and memory.memory_used <= 2 * block().num_bytes
    front = KVTier(ID, tmp_path / "behind", memory_bytes=block().num_bytes)
    for i, key in enumerate(keys):
        front.put(key, block(i))
    assert all(same(front.get(k), block(i)) for i, k in enumerate(keys))   # spilled to disk


def test_two_servers_share_one_directory(tmp_path):
    """Each finds what the other wrote after it started; a file the other removed is a miss,
    not a rejected file."""
    one, two = KVTier(ID, tmp_path), KVTier(ID, tmp_path)
    key = one.key((0, b"\5" * 32))
    one.put(key, block(5))
    assert key in two and same(two.get(key), block(5))
    other = one.key((0, b"\6" * 32))
    one.put(other, block(6))
    assert other in two
    (tmp_path / f"{other}{SUFFIX}").unlink()             # dropped by the other server
    assert two.get(other) is None and two.stats.rejected == 0
