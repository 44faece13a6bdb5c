"""Resuming a run saved before q/k/v and gate/up were fused into one parameter each.

Its trainer_state.pt holds one AdamW entry per checkpoint matrix (q_proj, k_proj, ...); the
optimizer now has one per fused parameter. AdamW is elementwise, so stacking the shards' moments
the way their weights are stacked resumes the run exactly where it stopped."""
from __future__ import annotations

from collections import defaultdict

import torch

from kvslim.errors import KvslimError


def is_unfused_state(saved: dict, optimizer: torch.optim.Optimizer) -> bool:
    """The saved groups hold more parameters than the optimizer's: the old, unfused layout."""
    old = [len(g["params"]) for g in saved["param_groups"]]
    new = [len(g["params"]) for g in optimizer.param_groups]
    return len(old) == len(new) and old != new and all(o >= n for o, n in zip(old, new))


def fuse_optimizer_state(saved: dict, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer) -> dict:
    """`saved` (an AdamW state dict of the unfused model, groups split by weight dimension as
    `make_optimizer` does) in the layout of `optimizer`, ready for its load_state_dict."""
    order, parts = _checkpoint_names(model)
    old_groups = [[n for n in order if parts.shape_of[n].dim() >= 2],
                  [n for n in order if parts.shape_of[n].dim() < 2]]
    if [len(g) for g in old_groups] != [len(g["params"]) for g in saved["param_groups"]]:
        raise KvslimError("trainer_state.pt does not match this model's parameters")
    old_state = {name: saved["state"].get(index)
                 for group, names in zip(saved["param_groups"], old_groups)
                 for index, name in zip(group["params"], names)}
    current = optimizer.state_dict()
    state = {}
    for group, new_group in zip(current["param_groups"], optimizer.param_groups):
        for index, param in zip(group["params"], new_group["params"]):
            shards = [old_state[name] for name in parts.names_of[id(param)]]
            if all(s is not None for s in shards):
                state[index] = _stack(shards, param)
    groups = [dict(old, params=new["params"])
              for old, new in zip(saved["param_groups"], current["param_groups"])]
    return {"state": state, "param_groups": groups}


class _Parts:
    def __init__(self):
        self.names_of: dict[int, list[str]] = {}       # id(parameter) -> names, in row order
        self.shape_of: dict[str, torch.Tensor] = {}     # name -> its view


def _checkpoint_names(model) -> tuple[list[str], _Parts]:
    """Checkpoint names in the order the unfused model listed its parameters (a tied weight
    once), and which of them each parameter stacks. Found through memory: a name's tensor in
    `hf_state_dict()` is a view into the parameter that holds it."""
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    parts, rows, order, seen = _Parts(), defaultdict(list), [], set()
    for name, view in model.hf_state_dict().items():
        param = params.get(view.untyped_storage().data_ptr())
        key = (id(param), view.storage_offset())
        if param is None or key in seen:
            continue
        seen.add(key)
        order.append(name)
        parts.shape_of[name] = view
        rows[id(param)].append((view.storage_offset(), name))
    parts.names_of = {pid: [name for _, name in sorted(found)] for pid, found in rows.items()}
    return order, parts


def _stack(shards: list[dict], param: torch.Tensor) -> dict:
    step = shards[0]["step"]
    out = {"step": step.clone() if isinstance(step, torch.Tensor) else step}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = torch.cat([s[key].reshape(-1, *param.shape[1:]) for s in shards]
                             ).reshape(param.shape)
    return out
