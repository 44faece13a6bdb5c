"""The KV budget compiler's arithmetic: per-layer bytes add up to the engine's own pricing, and
the plan is exact (brute force over every combination agrees on random small instances)."""
import itertools
import random

import pytest

from kvslim.errors import KvslimError
from kvslim.kv_cache.budget import (KVSetting, compile_plan, default_windows,
                                    layer_bytes_per_token, sequence_bytes)
from kvslim.models.config import ModelConfig

SETTINGS = [KVSetting("auto"), KVSetting("int8"), KVSetting("int4"), KVSetting("int2"),
            KVSetting("int8", 64), KVSetting("int4", 64)]


@pytest.mark.parametrize("precision", ["float32", "int8", "int4", "int2"])
def test_layer_bytes_add_up_to_the_engines_pricing(hf_checkpoints, precision):
    config = ModelConfig.from_dir(hf_checkpoints["gqa"])
    total = sum(layer_bytes_per_token(config, l, precision, 16)
                for l in range(config.num_hidden_layers))
    assert total == pytest.approx(config.kv_cache_block_bytes(precision, 16) / 16)
    full = sequence_bytes(config, 0, KVSetting(precision), precision, 1000, 4, 16)
    windowed = sequence_bytes(config, 0, KVSetting(precision, 64), precision, 1000, 4, 16)
    assert windowed == pytest.approx(full * 80 / 1008, rel=1e-6)     # 5 blocks of 63


def _instance(seed: int, layers: int):
    rng = random.Random(seed)
    options = [{s: (rng.randint(1, 40), round(rng.random() * 3, 3)) for s in
                rng.sample(SETTINGS, rng.randint(1, 4))} for _ in range(layers)]
    low = sum(min(b for b, _ in o.values()) for o in options)
    high = sum(max(b for b, _ in o.values()) for o in options)
    return options, rng.randint(low, high)


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_the_best_combination(seed):
    options, budget = _instance(seed, layers=1 + seed % 5)
    settings, used, loss = compile_plan(options, budget)
    feasible = [(sum(o[c][1] for o, c in zip(options, combo)),
                 sum(o[c][0] for o, c in zip(options, combo)))
                for combo in itertools.product(*[list(o) for o in options])
                if sum(o[c][0] for o, c in zip(options, combo)) <= budget]
    assert loss == pytest.approx(min(f[0] for f in feasible))
    assert used <= budget and used == sum(o[s][0] for o, s in zip(options, settings))
    assert loss == pytest.approx(sum(o[s][1] for o, s in zip(options, settings)))


def test_a_budget_below_the_cheapest_plan_is_refused():
    with pytest.raises(KvslimError, match="below the cheapest plan's 7"):
        compile_plan([{KVSetting("int2"): (3, 1.0)}, {KVSetting("int2"): (4, 1.0)}], 6)


def test_default_windows_are_fractions_of_the_context():
    assert default_windows(1024) == (64, 256, 512, 768)
    assert default_windows(8) == (2, 4, 6) and default_windows(2) == (1,)
