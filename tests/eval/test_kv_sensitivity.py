"""Each layer's KV sensitivity: the exact setting costs nothing, fewer bits cost more, a window
shorter than the text costs something; int8 degradation is the engine's own arithmetic."""
import pytest
import torch

from kvslim.attention.kv_cache import dequantize, quantize
from kvslim.eval.kv_sensitivity import degrade, layer_sensitivity
from kvslim.formats.loader import load_model
from kvslim.kv_cache.budget import KVSetting

SETTINGS = [KVSetting("auto"), KVSetting("int8"), KVSetting("int4"), KVSetting("int2"),
            KVSetting("auto", 8)]


@pytest.fixture(scope="module")
def losses(hf_checkpoints):
    model = load_model(hf_checkpoints["gqa"], dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 300, (2, 48), generator=g)]
    return layer_sensitivity(model, batches, SETTINGS, sinks=2, block_size=16)


def test_fewer_bits_and_a_window_cost_more(losses):
    for layer in losses:
        assert layer[KVSetting("auto")] == pytest.approx(0.0, abs=1e-7)
        assert 0 < layer[KVSetting("int8")] < layer[KVSetting("int2")]
        assert layer[KVSetting("int4")] < layer[KVSetting("int2")]
        assert layer[KVSetting("auto", 8)] > 0


def test_int8_is_the_caches_arithmetic():
    x = torch.randn(2, 5, 2, 16)
    q, scale = quantize(x, torch.int8)
    assert torch.equal(degrade(x, "int8", 16, keys=True), dequantize(q, scale, torch.float32))
    assert torch.equal(degrade(x, "auto", 16, keys=False), x)


def test_one_layers_plan_measures_its_own_loss(hf_checkpoints, losses):
    from kvslim.eval.kv_sensitivity import plan_kl
    model = load_model(hf_checkpoints["gqa"], dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 300, (2, 48), generator=g)]
    plan = [KVSetting("int2")] + [KVSetting("auto")] * (model.config.num_hidden_layers - 1)
    assert plan_kl(model, batches, plan, sinks=2) == pytest.approx(losses[0][KVSetting("int2")])
    everything = plan_kl(model, batches, [KVSetting("int2")] * model.config.num_hidden_layers,
                         sinks=2)
    assert everything > losses[0][KVSetting("int2")]
