"""Per-layer KV-head budgets (`kvslim convert --kv-budget`): how many KV heads each layer keeps
when the whole model may cache a given number of bytes per token.

Every KV head of every layer costs the same bytes per token (K and V, head_dim each), so a byte
budget is a budget of KV heads summed over layers. `allocate` chooses one count per layer from
that layer's candidates (divisors of its source count) to minimise the summed predicted loss
under the budget, exactly, by dynamic programming over (layers, heads used): at most
layers x total heads states, a few thousand for the models kvslim converts."""
from __future__ import annotations

import math

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig


def candidate_heads(source_heads: int) -> list[int]:
    """What a layer with `source_heads` KV heads can be pooled to: the divisors, largest first."""
    return [k for k in range(source_heads, 0, -1) if source_heads % k == 0]


def heads_budget(config: ModelConfig, fraction: float | None = None,
                 bytes_per_token: int | None = None, dtype_bytes: int | None = None) -> int:
    """The budget in KV heads summed over layers, from a fraction of the source's KV bytes or
    from KV bytes per token (priced in `dtype_bytes` per element, default the stored dtype's).
    A budget above the source's, or below one head per layer, is an error."""
    total = sum(config.kv_heads_per_layer)
    layers = config.num_hidden_layers
    if (fraction is None) == (bytes_per_token is None):
        raise KvslimError("give one of --kv-budget FRACTION and --kv-bytes-per-token N")
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise KvslimError(f"--kv-budget {fraction:g} must be in (0, 1]: a fraction of the "
                              f"source's KV bytes (above 1 is more than the source has)")
        # 1e-9: 0.25 of 48 heads is 12 heads even where 0.25 * 48 rounds below 12
        budget, asked = math.floor(fraction * total + 1e-9), f"--kv-budget {fraction:g}"
    else:
        from kvslim.dtypes import parse_dtype
        itemsize = dtype_bytes or parse_dtype(config.torch_dtype).itemsize
        # one KV head of one layer: the model's one-head pricing, per layer
        per_head = config.kv_elements_per_token(1) // layers * itemsize
        budget, asked = bytes_per_token // per_head, f"--kv-bytes-per-token {bytes_per_token}"
        if bytes_per_token > total * per_head:
            raise KvslimError(f"{asked} is above the source's {total * per_head} bytes per "
                              f"token; conversion only removes KV heads")
    if budget < layers:
        raise KvslimError(f"{asked} leaves {budget} KV heads for {layers} layers; every layer "
                          f"needs at least one (the smallest budget is {layers} of {total} "
                          f"heads, {layers / total:.4g} of the source's KV bytes)")
    return budget


def allocate(costs: list[dict[int, float]], budget: int) -> list[int]:
    """One KV head count per layer, from the keys of that layer's `costs` (count -> predicted
    loss): the whole budget when some choice sums to it (else the largest sum below it), and
    among those the smallest summed loss. Spending every head keeps a comparison at equal KV
    bytes honest, and measured losses are too noisy to trust one that says fewer heads are
    better. Raises when even the cheapest choice of every layer exceeds the budget."""
    if sum(min(c) for c in costs) > budget:
        raise KvslimError(f"a budget of {budget} KV heads cannot give each of {len(costs)} "
                          f"layers its smallest count ({sum(min(c) for c in costs)} heads)")
    # best[used] = (loss, -heads, choices) over the layers seen so far
    best: dict[int, tuple[float, int, list[int]]] = {0: (0.0, 0, [])}
    for layer_costs in costs:
        nxt: dict[int, tuple[float, int, list[int]]] = {}
        for used, (loss, neg, picks) in best.items():
            for k, cost in layer_costs.items():
                if used + k > budget:
                    continue
                cand = (loss + cost, neg - k, picks + [k])
                if used + k not in nxt or cand[:2] < nxt[used + k][:2]:
                    nxt[used + k] = cand
        best = nxt
    return best[max(best)][2]


def uniform_allocation(config: ModelConfig, budget: int) -> list[int]:
    """The same count in every layer: the largest that every layer can be pooled to and that
    fits the budget."""
    common = [k for k in candidate_heads(max(config.kv_heads_per_layer))
              if all(k0 % k == 0 for k0 in config.kv_heads_per_layer)]
    layers = config.num_hidden_layers
    fitting = [k for k in common if k * layers <= budget]
    if not fitting:
        raise KvslimError(f"no uniform KV head count fits {budget} heads over {layers} layers")
    return [fitting[0]] * layers
