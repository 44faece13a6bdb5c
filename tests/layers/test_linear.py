"""Fused linear layers load each checkpoint shard into its rows and give the shards back."""
import torch

from kvslim.layers.linear import MergedLinear, QKVLinear


def test_qkv_shards_go_to_their_rows_and_come_back():
    layer = QKVLinear(hidden=6, head_dim=2, num_heads=4, num_kv_heads=1, bias=True)
    shards = {"q": torch.randn(8, 6), "k": torch.randn(2, 6), "v": torch.randn(2, 6)}
    biases = {"q": torch.randn(8), "k": torch.randn(2), "v": torch.randn(2)}
    for key in ("v", "q", "k"):                       # any order
        layer.weight_loader(layer.weight, shards[key], key)
        layer.weight_loader(layer.bias, biases[key], key)
    assert torch.equal(layer.weight.detach(), torch.cat([shards["q"], shards["k"], shards["v"]]))
    assert torch.equal(layer.bias.detach(), torch.cat([biases["q"], biases["k"], biases["v"]]))
    views = layer.shard_views(layer.weight.detach())
    assert list(views) == ["q", "k", "v"]
    assert all(torch.equal(views[k], shards[k]) for k in shards)
    views["k"].zero_()                                # views share the parameter's memory
    assert torch.count_nonzero(layer.weight[8:10]) == 0


def test_merged_shard_ids_by_index_or_name():
    layer = MergedLinear(5, ("gate", "up"), 3)
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, "up")
    assert torch.equal(layer.weight.detach(), torch.cat([gate, up]))
    x = torch.randn(2, 5)
    torch.testing.assert_close(layer(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
