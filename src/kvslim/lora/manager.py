"""`LoRAManager`: the adapters an engine serves. Loaded adapters are kept on the host (up to
`max_cpu_loras`, least recently used dropped first); the `max_loras` slots of the model's
linears hold those a step runs. A slot is taken from the adapter used longest ago that the step
does not need; the scheduler never runs more distinct adapters at once than there are slots."""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch

from kvslim.errors import InvalidRequestError
from kvslim.lora.adapter import LoRAAdapter, load_adapter
from kvslim.lora.layer import LoRABatch, compute_dtype, wrap_linears
from kvslim.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.batch = LoRABatch()
        self.linears = wrap_linears(model, self.batch, max_loras, max_lora_rank)
        self.dtype, self.device = compute_dtype(model)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()   # on the host, LRU
        self.live: dict[int, int] = {}                   # lora_int_id -> unfinished requests
        self.slots: list[int | None] = [None] * max_loras               # lora_int_id per slot
        self.slot_order: list[int] = list(range(max_loras))              # least recent first
        self.loads = 0                                                   # slot writes so far

    # ---- the host cache ------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of `request`, read from its directory once (then kept, most recently
        used last); an id already held for another name or path is refused."""
        held = self.adapters.get(request.lora_int_id)
        if held is not None:
            if held.request != request:
                raise InvalidRequestError(
                    f"lora_int_id {request.lora_int_id} is already adapter "
                    f"{held.request.lora_name!r} ({held.request.lora_path})", "lora_request")
            self.adapters.move_to_end(request.lora_int_id)
            return held
        adapter = load_adapter(request, self.model, self.linears, self.max_rank, self.dtype)
        self.adapters[request.lora_int_id] = adapter
        idle = [i for i in self.adapters if not self.live.get(i) and i != request.lora_int_id]
        for lora_id in idle[:max(0, len(self.adapters) - self.max_cpu_loras)]:
            self.remove(lora_id)                 # oldest first; one in use is never dropped
        return adapter

    def acquire(self, request: LoRARequest) -> None:
        """A request will run with this adapter (read now if it is not held)."""
        self.add(request)
        self.live[request.lora_int_id] = self.live.get(request.lora_int_id, 0) + 1

    def release(self, lora_int_id: int) -> None:
        """A request that ran with this adapter has ended."""
        left = self.live.get(lora_int_id, 0) - 1
        if left > 0:
            self.live[lora_int_id] = left
        else:
            self.live.pop(lora_int_id, None)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is cleared); False if it was not held."""
        if self.live.get(lora_int_id):
            raise InvalidRequestError(f"LoRA adapter {lora_int_id} has unfinished requests",
                                      "lora_name")
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        if lora_int_id in self.slots:
            self._write(self.slots.index(lora_int_id), None)
        return True

    # ---- slots ---------------------------------------------------------------------------
    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Put these adapters in slots (those already there stay): lora_int_id -> slot."""
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(f"{len(lora_ids)} adapters in one step, max_loras is "
                               f"{self.max_loras}")       # the scheduler prevents it
        where = {}
        for lora_id in sorted(lora_ids):
            if lora_id in self.slots:
                where[lora_id] = self.slots.index(lora_id)
        for lora_id in sorted(lora_ids - set(where)):
            slot = next(s for s in self.slot_order if s not in where.values())
            self._write(slot, lora_id)
            where[lora_id] = slot
        for slot in where.values():                  # most recently used last
            self.slot_order.remove(slot)
            self.slot_order.append(slot)
        return where

    def _write(self, slot: int, lora_id: int | None) -> None:
        adapter = self.adapters.get(lora_id) if lora_id is not None else None
        for name, linear in self.linears.items():
            module = adapter.modules.get(name) if adapter is not None else None
            linear.set_slot(slot, module.shards if module is not None else None)
        self.slots[slot] = lora_id
        self.loads += lora_id is not None

    @contextmanager
    def step(self, entries: list):
        """The adapter of each token of a step's entries (ScheduledSequences in row order:
        each `num_tokens` rows of its `seq`) set for the model's linears while the pass runs."""
        self.begin_step([e.seq.lora_id for e in entries for _ in range(e.num_tokens)])
        try:
            yield
        finally:
            self.end_step()

    def begin_step(self, token_lora_ids: list[int]) -> None:
        """Each token's adapter (0: none), in the step's row order: its slots set for the
        linears, or none at all when no token has an adapter."""
        used = set(token_lora_ids) - {0}
        if not used:
            self.batch.token_slots = None
            return
        where = self.activate(used)
        slots = [where.get(i, -1) for i in token_lora_ids]
        self.batch.token_slots = torch.tensor(slots, dtype=torch.long).to(self.device)

    def end_step(self) -> None:
        self.batch.token_slots = None
