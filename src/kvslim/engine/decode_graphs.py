"""`DecodeGraphs`: pure-decode steps replayed as CUDA graphs.

A decode step of a small model on a GPU is a few hundred tiny kernels; launching them one by one
from Python costs more than running them. Like vLLM and nano-vllm, the engine records the whole
decoder for a decode batch once into a CUDA graph and then replays it with one launch per step.

A graph fixes every shape and address, so each one is captured for a padded batch size and a
padded block-table width (a power of two), on first use, reading from static buffers the step's
inputs are copied into. Padding rows are harmless: they write their K/V into a scratch block the
block manager never hands out, attend to one cached position and their outputs are dropped.
Without `use_graphs` (CPU) the same padded static-buffer path runs eagerly, which is how the
tests check it."""
from __future__ import annotations

import torch

from kvslim.attention import PagedAttention, PagedStepLayout, build_layer_metadata

MAX_GRAPHS = 64         # captured (batch, width) shapes; beyond that, new shapes run eagerly


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    def __init__(self, model, kv_caches, scratch_slot: int, max_num_seqs: int,
                 max_blocks_per_seq: int, layer_windows: list[int | None],
                 layer_group: list[int] | None = None, use_graphs: bool = False):
        """layer_group: each layer's KV-cache group; every group has its own slot mapping and
        block tables (static buffers [groups, ...])."""
        self.model, self.kv_caches = model, kv_caches
        layer_group = layer_group or [0] * len(layer_windows)
        self.layer_windows, self.layer_group = layer_windows, layer_group
        num_groups = max(layer_group) + 1
        self.use_graphs = use_graphs
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.max_blocks = max_blocks_per_seq
        self.block_size = kv_caches[0].block_size
        self.scratch_slot = scratch_slot
        dev = kv_caches[0].device
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((num_groups, n), scratch_slot, dtype=torch.long,
                                       device=dev)
        self.context_lens = torch.ones(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(num_groups, n, max_blocks_per_seq, dtype=torch.long,
                                        device=dev)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def shape_for(self, num_seqs: int, num_blocks: int) -> tuple[int, int] | None:
        """The padded (batch, table width) a step runs at, or None when it is too large."""
        batch = next((b for b in self.batch_sizes if b >= num_seqs), None)
        if batch is None or num_blocks > self.max_blocks:
            return None
        return batch, min(_next_power_of_two(num_blocks), self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            layouts: list[PagedStepLayout]) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a pure decode step (one layout per KV-cache group), or
        None if it must run eagerly."""
        n, width = input_ids.shape[0], layouts[0].decode_block_tables.shape[1]
        shape = self.shape_for(n, width)
        if shape is None or (shape not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
            return None
        batch, _ = shape
        self._fill(n, batch, input_ids, positions, layouts)
        if not self.use_graphs:
            return self._forward(*shape)[:n]
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(*shape)
        graph, hidden = self.graphs[shape]
        graph.replay()
        return hidden[:n]

    def _fill(self, n: int, batch: int, input_ids, positions,
              layouts: list[PagedStepLayout]) -> None:
        width = layouts[0].decode_block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.context_lens[:n] = layouts[0].decode_context_lens
        for g, layout in enumerate(layouts):
            self.slot_mapping[g, :n] = layout.slot_mapping
            self.block_tables[g, :n, :width] = layout.decode_block_tables
        # Padding rows: position 0, one key, K/V written into the scratch block.
        self.input_ids[n:batch] = 0
        self.positions[n:batch] = 0
        self.slot_mapping[:, n:batch] = self.scratch_slot
        self.context_lens[n:batch] = 1

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        layouts = [PagedStepLayout(
            slot_mapping=self.slot_mapping[g, :batch], num_decode_tokens=batch,
            decode_block_tables=self.block_tables[g, :batch, :width],
            decode_context_lens=self.context_lens[:batch])
            for g in range(self.slot_mapping.shape[0])]
        meta = build_layer_metadata(layouts, self.block_size, self.layer_windows,
                                    self.layer_group, graph_safe=True)
        attn = PagedAttention(self.kv_caches, meta)
        return self.model(self.input_ids[:batch], self.positions[:batch], attn=attn)

    def _capture(self, batch: int, width: int):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):          # warm-up: lazy inits happen outside capture
            self._forward(batch, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(batch, width)
        return graph, hidden
